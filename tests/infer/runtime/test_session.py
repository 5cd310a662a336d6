"""Exactness of the query path: where the method is exact, milo must be exact (fp32, 1e-4)."""
import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig
from milo_infer.tasks.corpus import load_corpus, task_from_corpus
from milo_infer.models import LoadedModel, model_identity
from milo_infer.runtime.session import MiloSession
from milo_infer.runtime.planning import EngineSettings
from milo_store import CompressionConfig, IncompatibleStoreError, MiloStore

pytestmark = pytest.mark.slow
DEMO = "milo_infer/tasks/data/demo_corpus.jsonl"
QUERY = "my card is gone, I think someone took it"


def small_store(tmp_path, loaded, name, *, n, block_size, w, codec, dtype="float32", full_rank=False, ratio=1.0):
    demos = load_corpus(DEMO)[:n]
    task = task_from_corpus(load_corpus(DEMO))
    config = BuildConfig(block_size=block_size, context_blocks=w, order="corpus",
                         compression=CompressionConfig(ratio=ratio, codec=codec, dtype=dtype, full_rank=full_rank))
    build_store(tmp_path / name, loaded, demos, task, config, progress=False)
    return MiloStore.open(tmp_path / name)


def plain_forward_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_block_identity_equals_plain_forward(tmp_path, default_model, default_model_qwen2, arch):
    loaded = default_model if arch == "llama" else default_model_qwen2
    store = small_store(tmp_path, loaded, "s", n=6, block_size=6, w=0, codec="identity")
    session = MiloSession(loaded, store)
    q = session.query_ids(QUERY)
    ids = store.meta["build"]["anchor_token_ids"] + store.token_ids(0).tolist() + q
    ours = session.logits(QUERY, block_ids=[0])
    ref = plain_forward_logits(loaded.model, ids)[-len(q):]
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_prefill_of_one_identity_block_at_no_context_equals_full(tmp_path, default_model):
    """With --context-blocks 0 and one block, the store's K/V is what a prompt's prefill computes: the
    `prefill` baseline and `full` must give the same logits, and prefill those of a plain forward."""
    store = small_store(tmp_path, default_model, "s", n=6, block_size=6, w=0, codec="identity")
    full, prefill = MiloSession(default_model, store), MiloSession(default_model, store, prefill=True)
    q = full.query_ids(QUERY)
    ids = store.meta["build"]["anchor_token_ids"] + store.token_ids(0).tolist() + q
    assert prefill.plan(QUERY, block_ids=[0]).query_ids == ids
    prefilled = prefill.logits(QUERY, block_ids=[0])
    assert torch.allclose(prefilled, plain_forward_logits(default_model.model, ids), atol=1e-4, rtol=0)
    ours = full.logits(QUERY, block_ids=[0])
    assert torch.allclose(prefilled[-len(q):], ours, atol=1e-4, rtol=0), (prefilled[-len(q):] - ours).abs().max()


def test_several_blocks_identity_equals_a_transformers_only_reference(tmp_path, default_model):
    """Reference from transformers' pieces alone: each block's forward in its encoding context, its
    cached post-RoPE keys rotated back and forth with the model's rotary embedding, a DynamicCache."""
    model = default_model.model
    store = small_store(tmp_path, default_model, "s", n=12, block_size=4, w=1, codec="identity")
    session = MiloSession(default_model, store)
    anchor = store.meta["build"]["anchor_token_ids"]
    blocks = [store.token_ids(i).tolist() for i in range(3)]
    order = [2, 0, 1]
    rotary = model.model.rotary_emb

    def table(positions):
        x = torch.empty(0, dtype=torch.float32)
        return rotary(x, torch.tensor([positions]))

    def encoded(i):
        context = anchor + (blocks[i - 1] if i > 0 else [])
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([context + blocks[i]]), use_cache=True)
        T = len(blocks[i])
        start = len(context)
        ks = [layer.keys[:, :, -T:] for layer in out.cache.layers]
        vs = [layer.values[:, :, -T:] for layer in out.cache.layers]
        return ks, vs, list(range(start, start + T))

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([anchor]), use_cache=True)
    keys = [[layer.keys] for layer in out.cache.layers]
    values = [[layer.values] for layer in out.cache.layers]
    pos = len(anchor)
    for i in order:
        ks, vs, enc_pos = encoded(i)
        cos_e, sin_e = table(enc_pos)
        new_pos = list(range(pos, pos + len(enc_pos)))
        cos_n, sin_n = table(new_pos)
        for l in range(len(keys)):
            pre, _ = apply_rotary_pos_emb(ks[l], ks[l], cos_e, -sin_e)  # rotate back to pre-RoPE
            post, _ = apply_rotary_pos_emb(pre, pre, cos_n, sin_n)
            keys[l].append(post)
            values[l].append(vs[l])
        pos += len(enc_pos)
    cache = DynamicCache(config=model.config)
    for l in range(len(keys)):
        cache.update(torch.cat(keys[l], dim=2), torch.cat(values[l], dim=2), l)
    q = session.query_ids(QUERY)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([q]), cache=cache, use_cache=True).logits[0].float()
    ours = session.logits(QUERY, block_ids=order)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_svd_full_rank_equals_identity_within_fp16_rounding(tmp_path, default_model):
    ident = MiloSession(default_model, small_store(tmp_path, default_model, "i", n=8, block_size=4, w=1,
                                                   codec="identity"))
    svd = MiloSession(default_model, small_store(tmp_path, default_model, "s", n=8, block_size=4, w=1, codec="svd",
                                                 dtype="float16", full_rank=True))
    a, b = ident.logits(QUERY, block_ids=[1, 0]), svd.logits(QUERY, block_ids=[1, 0])
    # fp16 factors: the logits move by rounding only; the predicted tokens do not
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    half = MiloSession(default_model, small_store(tmp_path, default_model, "h", n=8, block_size=4, w=1, codec="svd",
                                                  dtype="float16", ratio=0.3))
    c = half.logits(QUERY, block_ids=[1, 0])
    assert (a - c).abs().max() > (a - b).abs().max(), "compression must cost more than rounding"


def test_store_for_another_model_is_refused(tmp_path, default_model):
    from transformers import LlamaConfig, LlamaForCausalLM
    store = small_store(tmp_path, default_model, "s", n=4, block_size=4, w=0, codec="svd", dtype="float16", ratio=0.5)
    cfg = LlamaConfig(vocab_size=default_model.model.config.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    tiny = LlamaForCausalLM(cfg).eval()
    other = LoadedModel(tiny, default_model.tokenizer, model_identity(tiny))
    with pytest.raises(IncompatibleStoreError, match="num_layers"):
        MiloSession(other, store)


def test_answer_reports_blocks_bytes_and_stage_times(tmp_path, default_model):
    store = small_store(tmp_path, default_model, "s", n=12, block_size=4, w=1, codec="svd", dtype="float16", ratio=0.5)
    answer = MiloSession(default_model, store, settings=EngineSettings(k=2)).answer(QUERY)
    assert answer.text in task_from_corpus(load_corpus(DEMO)).labels
    assert len(answer.blocks) == 2 and 0 < answer.kv_bytes_stored < answer.kv_bytes_full
    assert {"retrieve", "read", "rebuild", "model"} <= set(answer.seconds)
    assert np.isclose(answer.kv_bytes_stored / answer.kv_bytes_full, 0.5, atol=0.1)


def test_int8_factors_track_identity_closer_than_fp16_at_equal_bytes(tmp_path, default_model):
    ident = MiloSession(default_model, small_store(tmp_path, default_model, "i", n=8, block_size=4, w=1,
                                                   codec="identity"))
    int8 = MiloSession(default_model, small_store(tmp_path, default_model, "q", n=8, block_size=4, w=1, codec="svd",
                                                  dtype="int8", ratio=0.5))
    fp16 = MiloSession(default_model, small_store(tmp_path, default_model, "h", n=8, block_size=4, w=1, codec="svd",
                                                  dtype="float16", ratio=0.5))
    assert int8.store.accounting()["ratio"] <= 0.5
    a = ident.logits(QUERY, block_ids=[1, 0])
    q, h = int8.logits(QUERY, block_ids=[1, 0]), fp16.logits(QUERY, block_ids=[1, 0])
    assert (a - q).abs().max() < (a - h).abs().max()
