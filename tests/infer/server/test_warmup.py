"""A server ready before it says so (issue 55): the start's warm-up drives the engine through batches of 1, 2, 4,
... rows of each store's demonstrations, so compiled FlexAttention's shapes are compiled before traffic;
/health answers 503 "warming" until then, requests queue meanwhile, and compiles under traffic are counted. The
real engine with FlexAttention on the CPU, at tiny shapes; torch.compile's cache stands in as `ShapeCache` (a
graph per new shape of the call's query and pools, what a compile for static shapes keys on), so these run in
seconds: compiling for real takes ~10 s a shape here (tests/infer/runtime/test_attention.py compiles)."""
import concurrent.futures
import threading

import httpx
import pytest

from torch.nn.attention.flex_attention import flex_attention

from milo_infer.bench import synthetic_model
from milo_infer.runtime import attention
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings
from milo_infer.server import scheduler, warmup as warming
from milo_infer.server.warmup import halvings, should_warm, warm_engine, warm_sizes
from milo_store import MiloStore

from tests.infer.server.serving import metric, serving

ROWS = 4
TIMEOUT_S = 120


class ShapeCache:
    """FlexAttention run uncompiled, counting a graph for each new (query, pools) shape it is called with."""

    def __init__(self):
        self.shapes = set()

    def compiled_flex(self, device_type):
        def attend(query, key, value, **kwargs):
            self.shapes.add((tuple(query.shape), tuple(key.shape), query.dtype))
            return flex_attention(query, key, value, **kwargs)
        return attend

    def graphs(self) -> int:
        return len(self.shapes)


@pytest.fixture
def compiles(monkeypatch):
    cache = ShapeCache()
    monkeypatch.setattr(attention, "compiled_flex", cache.compiled_flex)
    for module in (scheduler, warming):
        monkeypatch.setattr(module, "compiled_graphs", cache.graphs)
    return cache


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    loaded = synthetic_model.random_model("tiny")
    paths = synthetic_model.synthetic_stores(tmp_path_factory.mktemp("warm"), loaded, demos=32, block_size=8,
                                             demo_tokens=10, ratios=(0.5,), methods="milo", device="cpu")
    with MiloStore.open(paths["milo-r0.5"]) as opened:
        yield loaded, opened


def flex_engine(store) -> Engine:
    loaded, opened = store
    # rows holding their own copies: on the CPU, rows placing held blocks leave compiled FlexAttention for the per-row
    # loop (it returns them no log-sum-exp in torch 2.13), and these count FlexAttention's shapes
    return Engine(loaded, {"s": opened}, EngineSettings(k=2), attention="flex", max_rows=ROWS, kv_cache_memory=4 << 20,
                  shared_blocks=False)


def ask_all(base: str, queries: list[str]) -> list[httpx.Response]:
    def ask(text):
        return httpx.post(f"{base}/v1/completions", json={"model": "s", "prompt": text}, timeout=TIMEOUT_S)
    with concurrent.futures.ThreadPoolExecutor(len(queries)) as pool:
        return list(pool.map(ask, queries))


def test_the_sizes_and_when_to_warm():
    assert warm_sizes(16) == [1, 2, 4, 8, 16] and warm_sizes(6) == [1, 2, 4, 6] and warm_sizes(64, 3) == [1, 2, 3]
    assert should_warm("auto", "flex") and not should_warm("auto", "rows") and should_warm("all", "rows")
    assert not should_warm("none", "flex") and halvings(8) == [8, 4, 2, 1] and halvings(6) == [6, 4, 2, 1]
    with pytest.raises(ValueError, match="warm-up mode must be one of auto, all, none"):
        should_warm("some", "flex")


def test_health_says_warming_until_the_warm_up_ends_and_traffic_then_compiles_nothing(store, compiles):
    engine = flex_engine(store)
    gate, result = threading.Event(), {}

    def warmup():
        gate.wait(TIMEOUT_S)
        result.update(warm_engine(engine, warm_sizes(ROWS)))
        return result

    queries = synthetic_model.synthetic_queries(ROWS, 4, 2)
    with serving(engine, max_batch=ROWS, warmup=warmup) as served:
        health = httpx.get(f"{served.base}/health")
        assert (health.status_code, health.json()) == (503, {"status": "warming"})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            early = pool.submit(ask_all, served.base, queries[:1])  # queued while warming, answered after
            gate.set()
            assert [r.status_code for r in early.result(TIMEOUT_S)] == [200]
        assert httpx.get(f"{served.base}/health").status_code == 200
        assert result["batches"] == 1 + 2 + 3 and not result["failed"] and result["graphs"] > 0
        assert metric(served.base, "milo:warmup_seconds") == pytest.approx(result["seconds"])
        replies = ask_all(served.base, queries) + ask_all(served.base, queries[:2]) + ask_all(served.base, queries[:3])
        assert [r.status_code for r in replies] == [200] * len(replies)
        assert metric(served.base, "milo:compiled_graphs_after_warmup_total") == 0


def test_without_warm_up_the_compiles_under_traffic_are_counted(store, compiles):
    engine = flex_engine(store)
    with serving(engine, max_batch=ROWS) as served:
        assert httpx.get(f"{served.base}/health").status_code == 200  # nothing to warm: ready at once
        replies = ask_all(served.base, ["a question about topic3 never asked before with more words in it"] * 3)
        assert [r.status_code for r in replies] == [200] * 3
        assert compiles.graphs() >= 2  # a prefill shape and a decode shape at least
        assert metric(served.base, "milo:compiled_graphs_after_warmup_total") == compiles.graphs()
        assert metric(served.base, "milo:warmup_seconds") == 0


@pytest.mark.parametrize("argv, message", [
    (["--warmup-rows", "0"], "--warmup-rows must be at least 1"),
    (["--vllm", "http://127.0.0.1:9", "--warmup", "all"], "--warmup is milo's own engine's"),
    (["--warmup", "some"], "invalid choice: 'some'"),
])
def test_warm_up_flags_that_cannot_run_are_one_line_errors(argv, message, capsys):
    from milo_infer.cli.main import main as milo

    code = milo(["serve", "no-such-store", *argv])
    assert code == 2 and message in capsys.readouterr().err
