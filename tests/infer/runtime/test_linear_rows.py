"""A hybrid model's linear layers in the engine (`milo_infer.runtime.linear_rows`, issues 61 and 72): all rows of a
packed forward through a linear layer at once equal each row alone; a block put back after the anchor answers as
prefill does; an unreadable block is computed for its rows alone. The tiny random hybrids of `tests.infer.families`
(three linear layers, one attention layer), fp32 identity stores encoded after the anchor alone."""
import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_infer.building.builder import BuildConfig, build_store
from milo_infer.evaluation.conformance import Deviation
from milo_infer.models.capture import attention_modules, linear_rule
from milo_infer.models.families import layer_specs
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import Request
from milo_store import CompressionConfig, MiloStore

from tests.infer import families
from tests.infer.demo_stores import corrupted_block

QUERY = "my card was charged twice"
HYBRIDS = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid", "nemotron_h", "lfm2"]


@functools.cache
def linear_layers(family: str) -> tuple[int, list]:
    """The family's tiny model's hidden size and linear layers: (module, its rule)."""
    model = families.tiny_model(family).model
    return model.config.hidden_size, [(module, linear_rule(spec)) for module, spec in
                                      zip(attention_modules(model), layer_specs(model.config)) if spec.state_values]


def random_start(module, rule, gen: torch.Generator):
    """A state and conv window as a row's composed prefix leaves them (any values: the rules are exact from any)."""
    return tuple(torch.randn(x.shape, generator=gen) for x in rule.zero_state(module))


@pytest.mark.parametrize("family", HYBRIDS)
@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.sampled_from([1, 1, 2, 7, 65, 130]), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_rows_through_a_linear_layer_at_once_equal_each_row_alone(family, lengths, seed):
    """`layer_steps` over rows of mixed lengths packed end to end (decoding rows of one token, prefill chunks within
    and past a chunk of the recurrence) gives each row's output, state and conv window as `layer_step` over the row
    alone, then again a step later: every row one token from what the first left, beside a row joining with a fresh
    state and several tokens. A row reading another's tokens (its conv window, the recurrence) or another's state
    fails it."""
    gen = torch.Generator().manual_seed(seed)
    width, layers = linear_layers(family)
    for module, rule in layers:
        rows = [(*random_start(module, rule, gen), n) for n in lengths]
        for _ in range(2):
            hidden = torch.randn(sum(n for _, _, n in rows), width, generator=gen)
            out, after = rule.layer_steps(module, hidden, rows)
            start = 0
            for (state, window, n), (state_after, window_after) in zip(rows, after):
                alone = rule.layer_step(module, hidden[start:start + n], state, window)
                for got, want in zip((out[start:start + n], state_after, window_after), alone):
                    scale = want.abs().max().item() if want.numel() else 0.0  # LFM2's state: none
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * (scale + 1))
                start += n
            rows = [(state, window, 1) for state, window in after] + [(*random_start(module, rule, gen), 7)]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, tmp_path_factory):
    loaded = families.tiny_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    config = BuildConfig(block_size=2, context_blocks=0, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    build_store(root / "clean", loaded, families.demonstrations(8), families.TASK, config, progress=False)
    bad = corrupted_block(root / "clean", root / "bad", span=64)
    with MiloStore.open(root / "clean", tier="disk") as clean, MiloStore.open(root / "bad", tier="disk") as damaged:
        yield request.param, loaded, clean, damaged, bad


@torch.inference_mode()
def test_a_block_put_back_after_the_anchor_answers_as_prefill(hybrid):
    """Encoded after the anchor alone, a block placed right after it is exactly what prefill computes there: its
    attention layers' K/V and its linear layers' state (the anchor's carried through its pair) and conv tail; every
    query token's logits within 1e-4."""
    family, loaded, clean, _, _ = hybrid
    engine = Engine(loaded, {"s": clean})
    anchor = [int(t) for t in clean.meta["build"]["anchor_token_ids"]]
    for block in range(clean.num_blocks):
        plan = engine.plan("s", Request(QUERY), block_ids=[block])
        ids = anchor + clean.token_ids(block).tolist() + plan.query_ids
        prefill = loaded.model(torch.tensor([ids])).logits[0, -len(plan.query_ids):].float()
        assert Deviation.of(engine.logits([plan])[0], prefill).relative <= 1e-4, (family, block)


def test_an_unreadable_block_is_computed_for_its_row_alone(hybrid):
    """A row placing a damaged block gets its state from the blocks it read, then the damaged block's tokens computed
    by the model from there (as the same row without that block, its tokens fed); a row beside it is unaffected."""
    family, loaded, clean, damaged, bad = hybrid
    engine, reference = Engine(loaded, {"s": damaged}, on_load_error="recompute"), Engine(loaded, {"s": clean})
    others = [b for b in range(clean.num_blocks) if b != bad]
    plans = [engine.plan("s", Request(QUERY), block_ids=[others[0], bad]),
             engine.plan("s", Request("refund please"), block_ids=others[1:3])]
    got = engine.logits(plans)
    expected = [reference.stores["s"].without_blocks(reference.plan("s", Request(QUERY), block_ids=[others[0], bad]),
                                                     {bad}),
                reference.plan("s", Request("refund please"), block_ids=others[1:3])]
    assert bad not in expected[0].blocks and len(expected[0].recompute) == int(clean.block_tokens[bad])
    want = reference.logits(expected)
    assert torch.isfinite(got[0]).all()
    for ours, theirs in zip(got, want):
        assert Deviation.of(ours, theirs).relative <= 1e-5, family
