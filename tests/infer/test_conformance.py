"""One conformance suite over every family milo accepts (`milo_infer.models.FAMILIES`), on tiny random-weight
models in fp32 (`tests/infer/families.py`): the checks `milo check-model` runs on a user's model
(`milo_infer.evaluation.conformance`), held here to fp32 rounding.

* capture: a block's stored keys (identity codec, full rank), rebuilt at the positions they were encoded at,
  and its stored values equal the K/V the model writes into its own cache in the same row, within 1e-5;
* re-positioning: blocks placed at new positions equal what the model computes for the same tokens there
  from the same context, and the engine's logits for a query equal transformers' over that cache, within 1e-4;
* the query-aware key weights read the queries the model's attention receives, within 1e-5;
* each goes red when a description is wrong (a dropped k_norm, a rotated NoPE layer, ...).
"""
import dataclasses

import pytest
import torch

from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig
from milo_infer.evaluation.conformance import TOLERANCES, Deviation, check_conformance
from milo_infer.models import (FAMILIES, REFUSED, UnsupportedModelError, check_supported, config_identity,
                               config_layer_rope_tables, layer_rope_tables, layer_specs)
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request
from milo_store import CompressionConfig, MiloStore
from tests.infer import families

QUERY = "my card was charged twice"


def conformance(loaded, tmp_path):
    return check_conformance(loaded, families.demonstrations(8), families.TASK, QUERY, block_size=2,
                             context_blocks=1, workdir=tmp_path)


@pytest.fixture(scope="module", params=list(families.TINY))
def report(request, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield request.param, conformance(families.tiny_model(request.param), tmp_path_factory.mktemp(request.param))
    finally:
        torch.set_num_threads(threads)


def largest(report, name: str) -> float:
    """The largest deviation of check ``name`` over the layers, each layer holding K/V checked (a layer that attends
    another's has none of its own to check; a latent layer's one unit is its keys). None: no layer has it."""
    specs = layer_specs(families.config(report.model_type))
    held = [bool(spec.kv_heads and spec.state_values) if name.endswith("state") else bool(spec.state_values)
            if name.endswith("conv") else spec.caches_values
            if name.endswith("values") else spec.holds_cache for spec in specs]
    if not name.startswith("query"):
        assert [name in layer for layer in report.layers] == held, name
    return max((layer[name].error for layer in report.layers if name in layer), default=None)


def test_every_accepted_family_has_a_tiny_model():
    assert set(families.TINY) == set(FAMILIES)


def test_capture_equals_the_models_own_cache(report):
    family, r = report
    assert r.blocks == 4
    for kind in ("keys", "values", "state", "conv"):  # a linear layer's state and conv tail (a hybrid's)
        assert (largest(r, f"capture {kind}") or 0) <= TOLERANCES[torch.float32]["capture"], (family, kind)


def test_blocks_at_new_positions_equal_the_models_computation_there(report):
    family, r = report
    for kind in ("keys", "values"):
        assert (largest(r, f"reposition {kind}") or 0) <= 1e-4, (family, kind)
    assert r.logits.error <= 1e-4, family
    assert r.passed, r.failures()


def test_query_weights_read_the_queries_attention_receives(report):
    family, r = report
    assert max(layer["query_scales"].relative for layer in r.layers if "query_scales" in layer) <= 1e-5, family


@pytest.mark.parametrize("family", list(families.TINY))
def test_the_config_alone_gives_the_models_tables_and_identity(family):
    """What the vLLM connector, which has the config and not the HF model, rotates with and checks stores by."""
    loaded = families.tiny_model(family)
    ours, models = config_layer_rope_tables(loaded.model.config, 300), layer_rope_tables(loaded.model, 300)
    for layer in range(loaded.model.config.num_hidden_layers):
        assert all(torch.equal(a, b) for a, b in zip(ours.layer(layer), models.layer(layer)))
    assert config_identity(loaded.model.config, torch.float32) == loaded.identity


WRONG = {  # family -> a description that misreads it, and the check that must say so
    "qwen3": (dict(keys=("k_proj",)), "capture keys"),  # k_norm dropped
    "olmo2": (dict(keys=("k_proj",)), "capture keys"),  # the projection's norm dropped
    "smollm3": (dict(nope=None), "capture keys"),  # its NoPE layers rotated
    "cohere": (dict(interleaved=False), "capture keys"),  # rotate-half instead of interleaved pairs
    "helium": (dict(regroup_tables=False), "reposition keys"),  # the rotary module's tables as they come
    "qwen3_moe": (dict(queries=("q_proj",)), "query_scales"),  # q_norm dropped
    "glm4": (dict(regroup_tables=False), "capture keys"),  # its partial rotary tables as the rotary module makes them
    "ernie4_5": (dict(regroup_tables=False), "reposition keys"),  # rotate-half tables on interleaved pairs
    "minimax_m2": (dict(keys=("k_proj",)), "capture keys"),  # the projection's norm dropped
    "dots1": (dict(queries=("q_proj",)), "query_scales"),  # q_norm dropped
    "cohere2": (dict(unwindowed_nope=False), "capture keys"),  # its full layers rotated
    "glm4_moe": (dict(interleaved=True, regroup_tables=True), "capture keys"),  # GLM-4's interleaved pairs
    "phi": (dict(interleaved=True), "capture keys"),  # its rotary over interleaved pairs
    "stablelm": (dict(keys=("no_norm", "k_proj")), "capture keys"),  # its LayerNorm per head dropped (the fallback read)
    "nemotron": (dict(keywords_kept=False), "logits"),  # the engine's batch kept from its attention
    "qwen3_vl_text": (dict(keys=("k_proj",)), "capture keys"),  # k_norm dropped
    "qwen2_5_vl_text": (dict(interleaved=True), "capture keys"),  # its multimodal RoPE read as interleaved pairs
    "qwen3_vl_moe_text": (dict(queries=("q_proj",)), "query_scales"),  # q_norm dropped
    "llama4_text": (dict(norm_after_rope=None), "capture keys"),  # its weightless norm after RoPE left out
    "deepseek_v3": (dict(interleaved=True, half_tables=True), "capture keys"),  # V2's raw pairs for its rope key
    "deepseek_v2": (dict(interleaved=False, half_tables=False), "capture keys"),  # V3's rotate-half layout
    "longcat_flash": (dict(latent_gains=None), "capture keys"),  # its latent's scale after the norm left out
}


def test_deepseek_v3s_rope_key_kept_in_its_raw_order_fails_its_check(tmp_path, monkeypatch):
    """rope_interleave turns the raw pairs (2i, 2i + 1) and caches evens then odds: a rope key stored raw is turned
    unlike the model's."""
    from milo_infer.models import latent

    monkeypatch.setattr(latent, "rope_order", lambda config, spec: None)
    r = conformance(families.tiny_model("deepseek_v3"), tmp_path)
    assert any("capture keys" in failure for failure in r.failures()), r.failures()


@pytest.mark.parametrize("family", list(WRONG))
def test_a_wrong_description_fails_its_check(family, tmp_path, monkeypatch):
    change, check = WRONG[family]
    monkeypatch.setitem(FAMILIES, family, dataclasses.replace(FAMILIES[family], **change))
    r = conformance(families.tiny_model(family), tmp_path)
    assert not r.passed and any(check in failure for failure in r.failures()), r.failures()


@pytest.mark.parametrize("family", ["minimax_m2", "nemotron"])
def test_a_rotary_width_one_pair_short_fails_its_check(family, tmp_path, monkeypatch):
    """Rotate-half partial rotary rebuilt as pairs (j, j + rotary_dim/2 - 1) over one pair fewer: the stored keys
    come back turned unlike the model's."""
    from milo_infer.runtime.prefix import StorePrefix

    real = StorePrefix.rope_layout
    monkeypatch.setattr(StorePrefix, "rope_layout", lambda self, layer: {
        **real(self, layer), "rotary_dim": real(self, layer)["rotary_dim"] - 2})
    r = conformance(families.tiny_model(family), tmp_path)
    assert any("capture keys" in failure for failure in r.failures()), r.failures()


def test_phi3_with_phi4_minis_partial_rotary_passes_every_check(tmp_path):
    """Phi-4-mini's rotate-half over 3/4 of the head (12 of 16 channels here), on Phi-3's fused projection."""
    loaded = families.tiny_model("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.75})
    assert loaded.identity["rope"]["rotary_dim"] == 12
    r = conformance(loaded, tmp_path)
    assert r.passed, r.failures()


WINDOWED = {  # families whose tiny config has no window, with one that bites (8 tokens of rows of ~40)
    "mistral": dict(sliding_window=8),  # every layer
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # the layers from max_window_layers
    "phi3": dict(sliding_window=8),
    "mixtral": dict(sliding_window=8),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=8),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_windowed_variants_pass_every_check(family, tmp_path):
    loaded = families.tiny_model(family, **WINDOWED[family])
    assert any(w is not None for w in FAMILIES[family].windows(loaded.model.config))
    r = conformance(loaded, tmp_path)
    assert r.passed, r.failures()


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba", "lfm2"])  # a family of each rule: gated_delta, mamba2, conv
def test_hybrids_pass_every_check_with_staged_layers_reused_as_on_cuda(family, tmp_path, monkeypatch):
    """The CPU staging each layer into buffers later layers' copies reuse, as CUDA does (`prefetch`,
    MILO_REUSE_STAGED): a linear layer's state and conv window the rebuild hands out are still its own once the
    layers after it are staged (the check composes every layer's first, then reads the model's logits). One family
    of each linear rule (the whole suite's hybrids take minutes); the engine's rows run under it in every hybrid
    family (tests/infer/runtime/test_linear_rows.py)."""
    monkeypatch.setenv("MILO_REUSE_STAGED", "1")
    r = conformance(families.tiny_model(family), tmp_path)
    assert r.passed, r.failures()


def test_gemma4_with_its_key_gain_dropped_fails_its_check(tmp_path, monkeypatch):
    """A K = V layer's keys are its stored values times its key norm's weight: rebuilt with a gain of ones, the full
    layers' keys come back unlike the model's (the sliding layers, which store their keys, still pass)."""
    from milo_infer.building import builder

    monkeypatch.setattr(builder, "key_gains", lambda model: torch.ones(4, 32) * (
        torch.tensor([s.keys_from_values for s in layer_specs(model.config)])[:, None]))
    r = conformance(families.tiny_model("gemma4_text"), tmp_path)
    assert [f for f in r.failures() if "capture keys" in f] and all(f.startswith("layer 1 ") or "logits" in f
                                                                    for f in r.failures()), r.failures()


def test_gemma4_proportional_rope_read_as_a_partial_rotary_fails_its_check(tmp_path, monkeypatch):
    """Its full layers' proportional RoPE turns pairs (j, j + d/2) of the whole head, the last three quarters of the
    frequencies zero: read as a rotate-half over the first quarter, their keys come back turned unlike the model's."""
    from milo_infer.models import families as described

    real = described.rotary_dim
    monkeypatch.setitem(FAMILIES, "gemma4_text", dataclasses.replace(FAMILIES["gemma4_text"], partial=True))
    monkeypatch.setattr(described, "rotary_dim", lambda config, layer=0: (
        described.head_dim(config, layer) // 4 if config.layer_types[layer] == "full_attention" else real(config, layer)))
    r = conformance(families.tiny_model("gemma4_text"), tmp_path)
    assert any(f.startswith("layer 1 capture keys") for f in r.failures()), r.failures()


def test_gemma4_shared_layers_attending_the_full_layers_page_tables_fail_the_logits(tmp_path, monkeypatch):
    """A layer that attends another's K/V reads its source's pools (the model hands it them), so it must read them
    through its source's page tables: the tiny model's layer 2, which attends window layer 0's, given the full layers'
    page tables attends the wrong columns."""
    from milo_infer.runtime import engine

    real = engine.model_windows
    monkeypatch.setattr(engine, "model_windows", lambda config: [w if l < 2 else None
                                                                 for l, w in enumerate(real(config))])
    r = conformance(families.tiny_model("gemma4_text"), tmp_path)
    assert any(f.startswith("logits") for f in r.failures()), r.failures()


ENGINE_WRONG = {  # family -> what the engine's attention would leave out of what the layer hands it
    "gemma3_text": "sliding_window", "ministral": "sliding_window", "gpt_oss": "s_aux", "gemma2": "softcap",
}


@pytest.mark.parametrize("family", list(ENGINE_WRONG))
def test_attention_that_leaves_out_a_window_a_sink_or_the_cap_fails_the_logits(family, tmp_path, monkeypatch):
    from transformers import AttentionInterface

    from milo_infer.runtime import attention

    def leaving_out(*args, **kwargs):
        kwargs.pop(ENGINE_WRONG[family])
        return attention.paged_attention(*args, **kwargs)
    AttentionInterface.register(attention.ATTENTION, leaving_out)
    try:
        r = conformance(families.tiny_model(family), tmp_path)
    finally:
        AttentionInterface.register(attention.ATTENTION, attention.paged_attention)
    assert any(failure.startswith("logits") for failure in r.failures()), r.failures()


@pytest.mark.parametrize("family", ["gemma3_text", "gemma2", "gpt_oss"])
def test_flex_attention_answers_window_cap_and_sink_families_as_transformers(family, tmp_path, monkeypatch):
    """The engine's `flex` path (CUDA's default; uncompiled here) over the same checks: each window size its own
    block mask in one forward, the cap as a score modifier, sinks from the log-sum-exp."""
    import functools

    from milo_infer.runtime import attention, engine

    monkeypatch.setattr(engine, "choose_attention", lambda name, device: "flex")
    monkeypatch.setattr(attention, "flex_rows", functools.partial(attention.flex_rows, compiled=False))
    r = conformance(families.tiny_model(family), tmp_path)
    assert r.passed and r.logits.relative > 0, (r.failures(), r.logits)  # > 0: not the rows path's SDPA


def test_the_global_rope_base_on_a_local_layer_fails_its_check(tmp_path, monkeypatch):
    from milo_infer.models import rope

    real = rope.rope_tables
    monkeypatch.setattr(rope, "rope_tables", lambda model, n, device=None, layer_type=None:
                        real(model, n, device, "full_attention" if layer_type else None))
    r = conformance(families.tiny_model("gemma3_text"), tmp_path)
    assert any("layer 0 capture keys" in failure for failure in r.failures()), r.failures()


@pytest.mark.parametrize("family", list(families.TINY))
def test_the_description_names_each_layers_window_scale_cap_and_sinks(family):
    """`Attention.windows` and `Attention.scores` (the store's identity, the docs' table, and what a window
    layer's reads will be cut to) against what each layer's module hands its attention function."""
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    seen = {}

    def record(module, query, key, value, mask, **kwargs):
        seen[module.layer_idx] = kwargs
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, mask, **kwargs)
    AttentionInterface.register("milo_test_windows", record)
    AttentionMaskInterface.register("milo_test_windows", eager_mask)
    model = families.tiny_model(family).model
    model.config._attn_implementation = "milo_test_windows"
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    config, spec = model.config, FAMILIES[family]
    layers = [l for l, shape in enumerate(layer_specs(config)) if shape.attends]  # a hybrid's linear layers attend none
    assert sorted(seen) == layers
    assert [seen[layer].get("sliding_window") for layer in layers] == [spec.windows(config)[l] for l in layers]
    scores = spec.scores(config)
    for layer in layers:
        assert seen[layer].get("softcap") == scores["softcap"]
        assert (seen[layer].get("s_aux") is not None) == scores["sinks"]
        if scores["scaling"] is not None:
            assert seen[layer]["scaling"] == pytest.approx(scores["scaling"])


@pytest.mark.parametrize("family", ["phimoe", "olmoe"])
def test_a_window_its_modeling_file_applies_half_way_is_refused(family, tmp_path):
    """PhiMoE masks by the window without telling its attention; OLMoE tells its attention and masks in full. The
    engine attends as the attention is told, so either would answer unlike transformers (logits off by 1.3-1.4,
    seen before the refusal): refused, naming why."""
    config = families.config(family, sliding_window=8)
    with pytest.raises(UnsupportedModelError, match="sliding_window=8 is active, which milo cannot follow"):
        check_supported(config)
    check_supported(families.config(family, sliding_window=None))


def test_the_vllm_connector_refuses_only_cohere2_with_a_window_mla_and_hybrids():
    """vLLM 0.32's Cohere 2 attends one token more than its window (transformers' does not); every other window
    model is served through vLLM's hybrid KV cache manager (`tests/infer/vllm/test_vllm_families.py`). vLLM's CPU
    DeepSeek answers unlike transformers' on its own. A hybrid's linear layers' states the connector does not load."""
    from milo_infer.models.families import vllm_problem

    assert "sliding_window + 1 = 9 tokens" in vllm_problem(families.config("cohere2"))
    assert all("its MLA layers" in vllm_problem(families.config(f)) for f in FAMILIES if FAMILIES[f].latent)
    assert all("Gated DeltaNet" in vllm_problem(families.config(f)) for f in FAMILIES if FAMILIES[f].linear)
    assert vllm_problem(families.config("cohere2", sliding_window=None)) is None
    assert all(vllm_problem(families.config(f)) is None for f in ("gemma3_text", "gpt_oss", "gemma2", "mistral"))


def test_nope_layers_and_a_partial_rotary_are_named_in_the_identity():
    assert families.tiny_model("smollm3").identity["rope"]["nope_layers"] == [1, 3]
    assert families.tiny_model("glm4").identity["rope"]["rotary_dim"] == 8  # half of head_dim 16
    assert families.tiny_model("llama").identity["rope"].keys() == {"layout", "theta", "scaling"}


# the identity of every store built before families had descriptions: config_hash and rope record as main wrote them
PINNED = {
    "llama": "a7df3fca4d2a", "qwen2": "f2d6cdc45270", "mistral": "30eec5b330fd",
}


@pytest.mark.parametrize("family", list(PINNED))
def test_the_first_families_identity_is_what_their_stores_hold(family):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    config = {"llama": LlamaConfig(), "qwen2": Qwen2Config(), "mistral": MistralConfig(sliding_window=None)}[family]
    identity = config_identity(config, torch.float32)
    assert identity["config_hash"].startswith(PINNED[family])
    assert identity["rope"] == {"layout": "half", "theta": 10000.0, "scaling": None}


@pytest.mark.parametrize("family, shifted_off", [("llama", False), ("hunyuan_v1_dense", True),
                                                  ("hunyuan_v1_moe", True)])
def test_only_a_norm_after_rope_makes_attention_depend_on_absolute_positions(family, shifted_off):
    """Why Hunyuan is refused (`families.KEY_NORM_AFTER_ROPE`): the same tokens fed 17 positions later give
    layer 1 other values (its query and key norms' weights sit between the two rotations), where Llama's are the
    same to fp32 rounding. Placing a stored block anywhere relies on the latter."""
    import transformers

    from milo_infer.evaluation.conformance import model_cache

    name = {"llama": "LlamaConfig", "hunyuan_v1_dense": "HunYuanDenseV1Config",
            "hunyuan_v1_moe": "HunYuanMoEV1Config"}[family]
    model = families.random_model(getattr(transformers, name)(**families.SHAPE, head_dim=16))
    ids = torch.randint(3, 300, (24,)).tolist()
    here, later = model_cache(model, ids, 0)[1][1], model_cache(model, ids, 17)[1][1]
    off = float((here - later).abs().max() / here.abs().max())
    assert (off > 0.05) if shifted_off else (off < 1e-5), off


def refused_configs():
    """A config of each refused family transformers here has, with the reason it must be refused for."""
    import transformers

    out = []
    for model_type, reason in REFUSED.items():
        try:
            out.append(pytest.param(transformers.AutoConfig.for_model(model_type), reason, id=model_type))
        except (ValueError, KeyError):  # not in this transformers
            continue
    return out


@pytest.mark.parametrize("config, reason", refused_configs())
def test_refused_families_name_their_reason(config, reason):
    with pytest.raises(UnsupportedModelError) as info:
        check_supported(config)
    assert reason in str(info.value)


def identity_store(loaded, path) -> MiloStore:
    """An identity store of four blocks of two demonstrations, as `check_conformance` builds one."""
    config = BuildConfig(block_size=2, context_blocks=1, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    build_store(path, loaded, families.demonstrations(8), families.TASK, config, progress=False)
    return MiloStore.open(path)


SHARED_ORDERS = [[3, 2, 1, 0], [0, 1, 2, 3], [2, 0], [1]]  # the same blocks at other offsets; block 3 in two rows
# blocks held beside blocks a row keeps in its own pages (issue 64): in one batch, block 3 only the first row places;
# decoding, the first row keeps 3 and 2 (not next to each other) and the third row 2
MIXED_ORDERS = [[3, 0, 2, 1], [0, 1], [2, 1], [1]]


def decoded_logits(engine: Engine, orders) -> list[list[torch.Tensor]]:
    """Per row, every logits row its decoder was given: the first two rows admitted together (they place the same
    blocks: held once), the others joining one by one, each after a step (the third finds its blocks held, the last
    joins once every earlier row has left and finds its block kept, reading none)."""
    from milo_infer.runtime.engine import Batch

    seen, advance = {}, Batch._advance

    def recording(self, row, logits):
        seen.setdefault(id(row.plan), []).append(logits.clone())
        return advance(self, row, logits)

    plans = [engine.plan("s", Request(text=QUERY), block_ids=order) for order in orders]
    batch = engine.batch()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Batch, "_advance", recording)
        for i, joining in enumerate([plans[:2], *([p] for p in plans[2:])], start=1):
            while i == len(plans) - 1 and len(batch):
                batch.step()
            batch.admit(joining)
            batch.step()
        while len(batch):
            batch.step()
    return [seen[id(p)] for p in plans]


@pytest.fixture(scope="module", params=list(families.TINY))
def shared_case(request, tmp_path_factory):
    loaded = families.tiny_model(request.param)
    store = identity_store(loaded, tmp_path_factory.mktemp(request.param) / "identity")
    yield request.param, loaded, store
    store.close()


def test_rows_placing_held_blocks_equal_rows_holding_their_own(shared_case):
    """Blocks held once and attended by turning each row's query (issue 54) against every row holding its own copy:
    the same block at other offsets in other rows, a block only one row places, windows that cut a held block
    (the window families' tiny windows of 8), sinks, soft-caps, NoPE layers, partial and interleaved rotary, RoPE per
    layer type, llama3 and YaRN scaling: every logit within 1e-4, in one batched prefill and decoding with rows
    joining one by one and leaving; with rows keeping the blocks no other row places in their own pages too."""
    held_equal_own(*shared_case)
    held_equal_own(*shared_case, orders=MIXED_ORDERS)


@pytest.mark.parametrize("shared_case", ["llama", "gpt_oss", "gemma2", "gemma3_text", "smollm3", "glm4_moe", "cohere"],
                         indirect=True)
def test_held_blocks_padded_into_one_call_equal_too(shared_case, monkeypatch):
    """CUDA's way (`attention.ONE_GROUP`: every held block padded into one call a layer, the scores written out),
    here on the CPU: windows, sinks, a soft-cap, NoPE, rotate-half partial and interleaved rotary."""
    from milo_infer.runtime import attention

    monkeypatch.setattr(attention, "ONE_GROUP", ("cuda", "cpu"))
    held_equal_own(*shared_case)


def held_equal_own(family, loaded, store, orders=SHARED_ORDERS) -> None:
    """Every block two rows place held once (the tiny stores' blocks, a few tokens each, are not worth a page held
    by the engine's own rule, `HeldBlocks.worth_holding`), against rows holding their own copies."""
    from milo_infer.runtime.shared_blocks import HeldBlocks

    settings = EngineSettings(k=4)
    held = Engine(loaded, {"s": store}, settings, shared_blocks=True, max_rows=4)
    own = Engine(loaded, {"s": store}, settings, shared_blocks=False, max_rows=4)
    if held.linear:  # a hybrid's rows compose their states from their own reads: none holds a block once
        assert not held.shared_blocks
        return rows_together_equal_each_alone(family, own, orders)
    assert held.shared_blocks and not own.shared_blocks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HeldBlocks, "worth_holding", staticmethod(lambda rows, tokens: rows > 1))
        prefill = [[held.plan("s", Request(text=QUERY), block_ids=o) for o in orders],
                   [own.plan("s", Request(text=QUERY), block_ids=o) for o in orders]]
        held_logits = held.logits(prefill[0])
        decoded = decoded_logits(held, orders)
    for a, b in zip(held_logits, own.logits(prefill[1])):
        assert Deviation.of(a, b).relative <= 1e-4, family
    for a, b in zip(decoded, decoded_logits(own, orders)):
        assert len(a) == len(b) > 0
        assert max(Deviation.of(x, y).relative for x, y in zip(a, b)) <= 1e-4, family


def rows_together_equal_each_alone(family, engine: Engine, orders) -> None:
    """A hybrid's rows in one batch, joining one by one and leaving, each from its own linear layers' state: every
    logits row as the row's alone (its state not carried into the next row's tokens, nor lost between steps)."""
    together = decoded_logits(engine, orders)
    for order, logits in zip(orders, together):
        alone = decoded_logits(engine, [order])[0]
        assert len(logits) == len(alone) > 0
        assert max(Deviation.of(x, y).relative for x, y in zip(logits, alone)) <= 1e-4, (family, order)


@pytest.mark.parametrize("rope", ["rope", "nope"])
def test_granite_4_h_with_and_without_rope_passes_every_check(rope, tmp_path):
    """Granite 4.0-H rotates only where position_embedding_type says "rope" (its released checkpoints: "nope")."""
    assert conformance(families.tiny_model("granitemoehybrid", position_embedding_type=rope), tmp_path).passed


def test_granite_4_h_read_as_nope_where_it_rotates_fails_its_check(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, "granitemoehybrid",  # the switch read from a field the config does not have
                        dataclasses.replace(FAMILIES["granitemoehybrid"], rope_switch="milo_test_missing"))
    report = conformance(families.tiny_model("granitemoehybrid", position_embedding_type="rope"), tmp_path)
    assert not report.passed and any("capture keys" in f for f in report.failures()), report.failures()
