"""The query path's device handling, checked on CPU: devices, stage clocks, the cache-fill guard.

What needs a GPU to run (side-stream copies, pinned sources, record_stream) is checked by reading
and by tools/gpu_check.sh; these tests cover the host-side logic around it.
"""
import pytest
import torch

from milo_infer.bench import synthetic_model
from milo_infer.cli import bench as bench_cli
from milo_infer.runtime.engine import cache_keyword
from milo_infer.runtime.session import MiloSession, default_device
from milo_infer.runtime.timing import StageClock
from milo_infer.runtime.planning import EngineSettings
from milo_store import MiloStore


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    loaded = synthetic_model.random_model("tiny")
    paths = synthetic_model.synthetic_stores(tmp_path_factory.mktemp("tiny"), loaded, demos=24, block_size=8, demo_tokens=6,
                                   ratios=(0.5,))
    return loaded, paths


def test_default_device_is_the_gpu_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")


def test_a_session_on_another_device_than_the_model_is_refused(tiny):
    loaded, paths = tiny
    with MiloStore.open(paths["milo-r0.5"]) as store:
        with pytest.raises(ValueError, match="model is on cpu but the session was asked to run on meta"):
            MiloSession(loaded, store, device="meta")


def test_a_model_that_ignores_the_cache_fails_loudly(tiny):
    """A transformers version that swallowed cache= would answer with no retrieved context at all."""
    loaded, paths = tiny
    with MiloStore.open(paths["milo-r0.5"]) as store:
        session = MiloSession(loaded, store, settings=EngineSettings(k=2))
        assert session.answer(synthetic_model.synthetic_queries(1, 3, 2)[0]).text  # the real model fills every layer
        model = loaded.model
        session.engine.model = lambda input_ids, **kw: model(input_ids=input_ids)  # drops the cache, under any keyword
        with pytest.raises(RuntimeError, match="did not use the milo cache"):
            session.answer(synthetic_model.synthetic_queries(1, 3, 2)[0])


class PastKeyValuesModel(torch.nn.Module):
    """The real model behind the keyword transformers 5.17 used for the cache (the model's own may be either)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, past_key_values=None, use_cache=True, **kwargs):
        return self.inner(input_ids=input_ids, use_cache=use_cache, **{cache_keyword(self.inner): past_key_values},
                          **kwargs)


def test_the_cache_goes_under_the_keyword_the_model_takes(tiny):
    loaded, paths = tiny
    query = synthetic_model.synthetic_queries(1, 3, 2)[0]
    with MiloStore.open(paths["milo-r0.5"]) as store:
        expected = MiloSession(loaded, store, settings=EngineSettings(k=2)).logits(query)
        session = MiloSession(loaded, store, settings=EngineSettings(k=2))
        session.engine.model = PastKeyValuesModel(loaded.model)
        session.engine.cache_kwarg = cache_keyword(session.engine.model)
        assert session.engine.cache_kwarg == "past_key_values"  # the model's own: "cache" or this, by version
        torch.testing.assert_close(session.logits(query), expected, rtol=0, atol=0)


def test_answer_reports_every_stage_and_the_model_excludes_rebuild(tiny, monkeypatch):
    loaded, paths = tiny
    with MiloStore.open(paths["milo-r0.5"]) as store:
        session = MiloSession(loaded, store, settings=EngineSettings(k=3))
        seen = []
        rebuild = session.engine.rebuild

        def slow_rebuild(factors, segments, out_k, out_v, cos, sin, *, plan, **kw):
            seen.append((segments.device, plan))
            torch.tensor(0.0).add_(1)  # stands for device work
            rebuild(factors, segments, out_k, out_v, cos, sin, plan=plan, **kw)

        monkeypatch.setattr(session.engine, "rebuild", slow_rebuild)
        a = session.answer(synthetic_model.synthetic_queries(1, 3, 3)[0])
    assert set(a.seconds) == {"retrieve", "read", "transfer", "wait", "rebuild", "model"}
    assert all(v >= 0 for v in a.seconds.values()) and a.seconds["rebuild"] > 0 and a.seconds["model"] > 0
    # the segment tables are host tensors planned before the forward: one per layer (a lone row holds its own copy of
    # its prefix), none moved per layer
    assert seen == [(torch.device("cpu"), None)] * store.layout.num_layers  # CPU: no Triton plan


def test_stage_clock_sums_host_device_and_deferred_stages():
    clock = StageClock("cpu")
    for _ in range(2):
        with clock.host("a"):
            pass
    with clock.device_stage("b"):
        torch.ones(64, 64) @ torch.ones(64, 64)
    clock.defer("b", lambda: 1.0)
    clock.defer("c", lambda: 2.0)
    out = clock.read()
    assert set(out) == {"a", "b", "c"} and out["a"] >= 0 and 1.0 < out["b"] < 2.0 and out["c"] == 2.0


def test_bench_creates_a_nested_out_folder_apart_from_its_stores(tmp_path):
    """tools/gpu_bench.sh keeps its stores elsewhere and writes to OUT/gpu_bench/throughput."""
    out = tmp_path / "reports" / "gpu_bench" / "throughput"
    code = bench_cli.main(["--synthetic", "tiny", "--shots", "16", "--block-size", "8", "--demo-tokens", "8",
                           "--k", "2", "--batch", "1", "--n-queries", "1", "--rounds", "1", "--ratios", "0.5",
                           "--stores", str(tmp_path / "stores"), "--out", str(out)])
    assert code == 0 and (out / "bench.md").is_file() and (out / "bench.json").is_file()
    assert not (out / "stores").exists() and (tmp_path / "stores" / "full").is_dir()
