"""milo_infer/bench/step_profile.py: a decode step's time split into stages that add up to the step, each the
engine's work it names (tools/bench_engine.py --profile prints the shares)."""
import pytest
import torch

from milo_infer.bench import synthetic_model
from milo_infer.bench.step_profile import STAGES, decoding_batch, profile_churn, profile_steps
from milo_infer.runtime import attention
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.pages import run_start
from milo_infer.runtime.planning import EngineSettings
from milo_store import MiloStore

from ..runtime.test_engine import random_llama
from ..runtime.test_shared_blocks import hold_every_shared_block

TEXTS = ["topic1 topic2 q", "topic3 a much longer question about topic0", "topic0 topic1 topic2 topic3 topic4"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    loaded = random_llama()
    paths = synthetic_model.synthetic_stores(tmp_path_factory.mktemp("profile"), loaded, demos=64, block_size=8,
                                             demo_tokens=20, ratios=(0.5,))
    with MiloStore.open(paths["milo-r0.5"]) as store:
        yield loaded, store


@pytest.fixture(scope="module")
def engine(setup):
    """Rows each holding their own copy of their prefix: the page layouts and per-row SDPA calls counted here."""
    loaded, store = setup
    return Engine(loaded, {"s": store}, EngineSettings(k=4), attention="rows", max_rows=4, shared_blocks=False)


def test_with_blocks_held_once_their_part_is_a_stage_of_its_own(setup, monkeypatch):
    """Rows placing held blocks: each row's own columns are an attention call a layer (``row_sdpa``), the held
    blocks' part one more a layer for all of them (``held_blocks``); the stages still add up to the step."""
    hold_every_shared_block(monkeypatch)
    loaded, store = setup
    engine = Engine(loaded, {"s": store}, EngineSettings(k=4), attention="rows", max_rows=4)
    batch = decoding_batch(engine, "s", TEXTS, 3)
    assert all(row.held for row in batch.rows)
    out = profile_steps(batch, 2)
    layers = engine.model_config.num_hidden_layers
    assert sum(out["seconds"].values()) == pytest.approx(out["step"], rel=0.05, abs=1e-3)
    assert out["calls"]["held_blocks"] == 2 * layers and out["seconds"]["held_blocks"] > 0
    assert out["calls"]["row_sdpa"] >= 2 * layers * 3  # each row's own part, and each held block's


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
def test_the_stages_add_up_to_the_steps_and_time_what_they_name(engine, scattered):
    batch = decoding_batch(engine, "s", TEXTS, 3, scattered=scattered)
    assert len(batch.rows) == 3 and not any(row.prefilling for row in batch.rows)
    assert all((run_start(row.pages) is None) == (scattered and len(row.pages) > 1) for row in batch.rows)
    assert any(len(row.pages) > 1 for row in batch.rows)
    out = profile_steps(batch, 2)
    layers = engine.model_config.num_hidden_layers
    assert set(out["seconds"]) == set(STAGES) and all(s >= 0 for s in out["seconds"].values())
    assert sum(out["seconds"].values()) == pytest.approx(out["step"], rel=0.05, abs=1e-3)
    assert out["calls"]["engine"] == 2 and out["calls"]["model"] == 2 and out["calls"]["decoding"] == 6
    assert out["calls"]["row_sdpa"] == out["calls"]["gathers"] * 3 == 2 * layers * 3
    assert out["calls"]["pool_writes"] == 2 * layers and out["calls"]["prefix_rebuild"] == 0
    for stage in ("model", "row_sdpa", "gathers", "pool_writes", "scheduler"):
        assert out["seconds"][stage] > 0, stage
    assert attention.sdpa_rows.__name__ == "sdpa_rows"  # the wrappers are gone
    assert torch.nn.functional.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"


def test_a_served_batch_refills_its_rows_and_times_their_admissions(engine):
    out = profile_churn(engine, "s", TEXTS, 2, 12)
    layers = engine.model_config.num_hidden_layers
    assert out["rows"] == 2 and 0 <= out["scattered"] <= 1
    assert sum(out["seconds"].values()) == pytest.approx(out["step"], rel=0.05, abs=1e-3)
    assert out["calls"]["admission"] >= 1 and out["calls"]["prefix_rebuild"] >= layers  # rows joined and were rebuilt
    assert out["seconds"]["admission"] > 0 and out["seconds"]["prefix_rebuild"] > 0


def test_the_op_profile_counts_a_steps_ops_syncs_and_uploads_and_names_where_they_come_from(engine):
    """milo_infer/bench/op_profile.py (tools/profile_step.py): one report shape on the CPU and CUDA; on the CPU the
    CUDA-only counts are None, the rest counted per step."""
    from milo_infer.bench.op_profile import format_report, profile_decode

    batch = decoding_batch(engine, "s", TEXTS, 3)
    out = profile_decode(batch, 2, top=40)
    assert out["rows"] == 3 and out["steps"] == 2 and out["attention"] == "rows"
    assert all(out[k] is None for k in ("launches", "kernels", "device_busy_ms", "device_idle_ms", "h2d", "d2h"))
    assert len(out["ops"]) == 40 and out["ops"][0]["host_ms"] >= out["ops"][-1]["host_ms"] >= 0
    assert out["step_ms"] == pytest.approx(out["host_ms_in_ops"] + out["host_gap_ms"])
    layers = engine.model_config.num_hidden_layers
    calls = {op["name"]: op["calls"] for op in out["ops"]}
    assert calls["aten::scaled_dot_product_attention"] == 3 * layers  # one a row and layer
    # the step builds its ids and kept indices from Python, and one position and one pool-column tensor a row
    assert out["host_tensors"] >= 2 + 2 * 3 and out["copies"] > 0
    assert out["syncs"] >= 3  # each row's next token read from its logits (the test's decoder: on the host)
    # the engine reads no tensor back within a step (a sync wherever the tensor is on a device)
    assert out["sites"]["syncs"] and not any("runtime/engine.py" in where for where in out["sites"]["syncs"])
    assert any(where.startswith("milo_infer/runtime/engine.py") for where in out["sites"]["host_tensors"])
    text = format_report(out)
    assert "n/a (CUDA only)" in text and "host tensors built" in text and "longest host gaps" in text


def test_a_cuda_profile_counts_launches_kernels_copies_syncs_and_the_devices_idle_time_inside_steps():
    """The CUDA half of the report, from a made-up profile of one step: what ran between steps (the
    synchronisation the profiler adds, a later kernel) counts for nothing."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from milo_infer.bench.op_profile import STEP, summarise

    def event(name, start, end, device=DeviceType.CPU):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               thread=1, is_python_function=False, self_cpu_time_total=end - start)
    cuda = DeviceType.CUDA
    events = [event(STEP, 0, 1000), event("aten::mm", 10, 200), event("cudaLaunchKernel", 20, 30),
              event("cudaLaunchKernel", 210, 220), event("aten::_local_scalar_dense", 300, 900),
              event("cudaStreamSynchronize", 310, 890), event("gemm", 100, 400, cuda),
              event("Memcpy HtoD (Pageable -> Device)", 500, 510, cuda),
              event("Memcpy DtoH (Device -> Pageable)", 850, 880, cuda),
              event("cudaDeviceSynchronize", 1001, 1100), event("gemm", 1200, 1300, cuda)]
    out = summarise(events, 1, cuda=True)
    assert (out["launches"], out["kernels"], out["h2d"], out["d2h"], out["d2d"]) == (2, 1, 1, 1, 0)
    assert out["syncs"] == 2 and out["syncs_by_op"] == {"aten::_local_scalar_dense": 1, "cudaStreamSynchronize": 1}
    assert out["device_busy_ms"] == pytest.approx(0.34) and out["device_idle_ms"] == pytest.approx(0.66)
    assert out["host_gap_ms"] == pytest.approx(0.2) and out["host_ms_in_ops"] == pytest.approx(0.8)
    assert out["longest_host_gaps"][0] == {"ms": pytest.approx(0.1), "after": "aten::_local_scalar_dense",
                                           "before": "step end"}
    assert out["ops"][0] == {"name": "gemm", "calls": 1, "host_ms": 0, "device_ms": pytest.approx(0.3)}
