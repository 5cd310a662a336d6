"""milo_infer/bench/synthetic_model.py's stores, built the fast way (issue 55): blocks drawn with their SVD known,
staged by threads, stores written in parallel; each mounts, verifies and answers as the store the old way (the
same draws factorised by `factorize_block`) does."""
import torch

from milo_infer.bench import synthetic_model
from milo_infer.bench.throughput import store_configs
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request
from milo_store import Layout, MiloStore, Staging, factorize_block, pack_block, write_store
from milo_store.synthetic import synthetic_block_kv

DEMOS, BLOCK, TOKENS = 32, 8, 10


def old_way(root, loaded, fast_path):
    """The MILO store the old path wrote: each block drawn by `synthetic_block_kv` from the same generator and
    factorised by SVD, the rest (demonstrations, anchor, attributes) the fast store's."""
    ident = loaded.identity
    layout = Layout(ident["num_layers"], ident["num_kv_heads"], ident["head_dim"])
    g = torch.Generator().manual_seed(0)
    staging = Staging(root / "staging-old", {"old": 0})
    for b in range(DEMOS // BLOCK):
        staging.put(b, factorize_block(*synthetic_block_kv(layout, BLOCK * TOKENS, g), codec="svd"))
    with MiloStore.open(fast_path) as fast:
        anchor, examples, attrs = fast.anchor_kv(), fast.examples(), dict(fast.meta)
    config = store_configs((0.5,), query_aware=False)["milo-r0.5"]
    return write_store(root / "old", staging, DEMOS // BLOCK, layout, config, attrs={k: attrs[k] for k in
                       ("model", "task", "build")}, anchor_kv=anchor, examples=examples, force=True)


def test_fast_stores_mount_verify_and_answer_as_the_old_way(tmp_path):
    loaded = synthetic_model.random_model("tiny")
    paths = synthetic_model.synthetic_stores(tmp_path, loaded, demos=DEMOS, block_size=BLOCK, demo_tokens=TOKENS,
                                             ratios=(0.5,), device="cpu", workers=2)
    assert set(paths) == {"full", "milo-r0.5"}
    old = old_way(tmp_path, loaded, paths["milo-r0.5"])
    ident = loaded.identity
    layout = Layout(ident["num_layers"], ident["num_kv_heads"], ident["head_dim"])
    g = torch.Generator().manual_seed(0)
    with MiloStore.open(paths["full"]) as full, MiloStore.open(paths["milo-r0.5"]) as fast, \
            MiloStore.open(old) as slow:
        for store in (full, fast, slow):
            assert store.verify_all() == []
        assert fast.num_blocks == full.num_blocks == DEMOS // BLOCK
        assert (fast.ranks == slow.ranks).all()  # the same spectra allocate the same ranks
        for b in range(full.num_blocks):  # the full store holds the old way's K/V (in fp16)
            k, v = synthetic_block_kv(layout, BLOCK * TOKENS, g)
            expected = pack_block(factorize_block(k, v, codec="identity"), full.ranks[b], "float16")
            assert torch.equal(full.block(b), expected)
        queries = synthetic_model.synthetic_queries(4, DEMOS // BLOCK, 2)
        answers = {}
        for name, store in (("fast", fast), ("slow", slow)):
            engine = Engine(loaded, {"s": store}, EngineSettings(k=2), attention="rows", max_rows=4)
            answers[name] = [a.text for a in engine.answer([engine.plan("s", Request(q)) for q in queries])]
        assert answers["fast"] == answers["slow"]


def test_milo_only_stages_no_identity_blocks(tmp_path):
    loaded = synthetic_model.random_model("tiny")
    paths = synthetic_model.synthetic_stores(tmp_path, loaded, demos=16, block_size=8, demo_tokens=6, ratios=(0.5,),
                                             methods="milo", device="cpu")
    assert set(paths) == {"milo-r0.5"} and not (tmp_path / "staging-identity").exists()
