"""The vLLM launcher's own choices, without vLLM: the defaults it adds on a CPU, and its one line when vLLM
refuses to start (a stand-in process prints vLLM's own words; a real refusal takes minutes here)."""
import sys
import textwrap

import pytest
import torch

from milo_infer.bench import synthetic_model
from milo_infer.vllm import launch
from milo_store import Layout, MiloStore

GiB = 1 << 30


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    torch.manual_seed(0)
    paths = synthetic_model.synthetic_stores(tmp_path_factory.mktemp("launch"), synthetic_model.random_model("tiny"),
                                             demos=8, block_size=4, demo_tokens=3, ratios=())
    return str(paths["full"])


def test_the_kv_cache_holds_a_few_full_sequences_within_half_the_free_memory():
    smollm2 = Layout(num_layers=30, num_kv_heads=3, head_dim=64)  # 46,080 fp32 bytes per token
    assert launch.cpu_kv_cache_bytes(smollm2, 8192, 1, 64 * GiB) == 4 * 8192 * 46080
    assert launch.cpu_kv_cache_bytes(smollm2, 8192, 2, 2 * GiB) == GiB // 2  # half of free, shared by 2 workers


def test_cpu_defaults_size_the_cache_and_bind_workers_unless_the_user_did(store, monkeypatch):
    monkeypatch.setattr(launch, "free_memory_bytes", lambda: 64 * GiB)
    monkeypatch.setattr(launch, "numa_nodes", lambda: 1)
    with MiloStore.open(store, tier="disk") as s:
        layout, positions = s.layout, s.meta["model"]["max_position_embeddings"]
    args, env = launch.defaults([store], ["--port", "8001"], {}, cpu=True)
    assert args == ["--kv-cache-memory-bytes", str(launch.cpu_kv_cache_bytes(layout, positions, 1, 64 * GiB))]
    assert env == {}  # one worker: vLLM binds it to the node itself
    args, env = launch.defaults([store], ["--max-model-len=512", "-tp", "2"], {}, cpu=True)
    assert args[1] == str(launch.cpu_kv_cache_bytes(layout, 512, 2, 64 * GiB))
    assert set(env) == {launch.THREADS_ENV} and env[launch.THREADS_ENV].count("|") == 1
    assert launch.defaults([store], ["--max-model-len", "1k"], {}, cpu=True)[0] == launch.defaults([store], [], {}, cpu=True)[0]
    for user_args, user_env in ((["--kv-cache-memory-bytes", "1000000"], {}), (["--gpu-memory-utilization=0.5"], {}),
                                ([], {launch.KV_CACHE_ENV: "2"})):
        assert launch.defaults([store], user_args, user_env, cpu=True)[0] == []
    assert launch.defaults([store], ["--pipeline-parallel-size", "2"], {launch.THREADS_ENV: "0-1|0-1"}, cpu=True)[1] == {}
    assert launch.defaults([store], ["-tp", "2"], {}, cpu=False) == ([], {})


def test_cpu_binding_splits_the_cpus_between_workers():
    assert launch.cpu_binding(2, [0, 1]) == "0|1"
    assert launch.cpu_binding(2, [4, 5, 6, 7]) == "4,5|6,7"
    assert launch.cpu_binding(3, [0, 1]) == "0|1|0"


def stand_in(output: str, code: int) -> list[str]:
    """A process that prints ``output`` on stderr as vLLM would, then exits with ``code``."""
    return [sys.executable, "-c", f"import sys; sys.stderr.write({output!r}); sys.exit({code})"]


VLLM_MEMORY_REFUSAL = textwrap.dedent("""\
    (EngineCore pid=1) ValueError: Available memory on node 0 (15.39/19.46 GiB) on startup is less than desired CPU memory utilization (0.92, 17.91 GiB). On the CPU backend, ...
    RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
    """)


@pytest.mark.parametrize("output, advice", [
    (VLLM_MEMORY_REFUSAL, "drop --gpu-memory-utilization so the launcher sizes the KV cache"),
    ("ValueError: To serve at least one request with the model's max seq len (8192), (1.41 GiB KV cache is needed, "
     "which is larger than the available KV cache memory (0.5 GiB). Based on the available memory, the estimated "
     "maximum model length is 2896. Try increasing\n", "pass --max-model-len 2896 or less"),
    ("KeyError: 'llama9'\nRuntimeError: Engine core initialization failed. See root cause above.\n",
     "vLLM did not start (vLLM: KeyError: 'llama9'); see its output above"),
])
def test_a_refusal_ends_with_one_line_saying_what_to_change(output, advice, capfd):
    assert launch.run(stand_in(output, 1), {}) == 1
    lines = capfd.readouterr().err.splitlines()
    assert lines[:-1] == output.splitlines()  # vLLM's own output, relayed unchanged
    assert lines[-1].startswith("milo launch: vLLM did not start") and advice in lines[-1], lines[-1]


def test_a_server_that_served_then_failed_gets_no_advice(capfd):
    output = "INFO:     Application startup complete.\nRuntimeError: the engine died\n"
    assert launch.run(stand_in(output, 3), {}) == 3
    assert capfd.readouterr().err == output
