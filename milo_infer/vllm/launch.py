"""vLLM's OpenAI server with the milo connector over stores: run with the python of vLLM's venv.

    .venv-vllm/bin/python -m milo_infer.vllm.launch stores/banking77 [--tier disk] -- --port 8001 [vLLM's flags]

Each store is named by its basename, as `milo serve` names it, so ``milo serve --vllm URL`` over the
same stores finds them. The model is the stores' (``--model``, default the default model's HF
directory); prefix caching is left as vLLM's default (loaded prefixes then also serve later requests
from vLLM's own cache). Everything after ``--`` goes to vLLM unchanged. On a CPU vLLM the launcher sizes
the KV cache and, with more workers than NUMA nodes, gives each worker its own CPUs (`defaults`), unless
the user's flags or environment do; when vLLM refuses to start, the last line says what to change
(`refusal`).
"""
import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import PurePosixPath

from milo_store import Layout, MiloStore
from milo_store.layers import cache_values_per_token

from ..models import model_directory
from ..runtime.pages import free_memory_bytes
from .transfer import connector_config

KV_CACHE_SEQUENCES = 4  # full-length sequences a default CPU KV cache holds: a few requests at once
KV_CACHE_SHARE_OF_FREE = 0.5  # at most this share of the memory free at launch, over all workers
KV_BYTES_PER_VALUE = 4  # sized for fp32 K/V, the widest dtype vLLM keeps on CPU
KV_CACHE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")  # the user sized it themselves
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's own (GiB), which wins over the flags
THREADS_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's: each CPU worker's cores, "|" between workers


def store_names(stores: list[str]) -> list[str]:
    names = [PurePosixPath(str(s).rstrip("/")).name for s in stores]
    if len(set(names)) != len(names):
        raise SystemExit(f"two stores share a basename ({', '.join(names)}): rename one")
    return names


def command(stores: list[str], model: str = "default", tier: str = "host", load_failure: str = "recompute",
            vllm_args: tuple[str, ...] = (), python: str = sys.executable) -> list[str]:
    """The command line that starts vLLM's server with the connector over ``stores``."""
    config = connector_config(dict(zip(store_names(stores), stores)), load_failure=load_failure, tier=tier)
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_directory(model)),
            "--kv-transfer-config", json.dumps(config), *vllm_args]


def launcher_command(stores: list[str], python: str, *, model: str = "default", tier: str = "host",
                     vllm_args: tuple[str, ...] = ()) -> list[str]:
    """This launcher as a newcomer types it, for tools and tests that start vLLM the same way."""
    return [python, "-m", "milo_infer.vllm.launch", *map(str, stores), "--model", str(model), "--tier", tier,
            "--", *vllm_args]


def flag_value(args: list[str], *names: str) -> str | None:
    """The value a flag is given in vLLM's arguments (``--name value`` or ``--name=value``), else None."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


def cpu_kv_cache_bytes(layout: Layout, max_model_len: int, workers: int, free_bytes: int) -> int:
    """KV cache bytes for each CPU worker: ``KV_CACHE_SEQUENCES`` sequences of ``max_model_len`` tokens of the
    stores' model (every layer and head: a worker holding a share needs less), within
    ``KV_CACHE_SHARE_OF_FREE`` of the free memory shared by the ``workers``."""
    per_token = cache_values_per_token(layout.layers) * KV_BYTES_PER_VALUE
    wanted = KV_CACHE_SEQUENCES * max_model_len * per_token
    return max(1 << 20, min(wanted, int(free_bytes * KV_CACHE_SHARE_OF_FREE) // workers))


def numa_nodes() -> int:
    try:
        with open("/sys/devices/system/node/online") as f:  # e.g. "0" or "0-1"
            return sum(int(b) - int(a) + 1 for a, _, b in (r.partition("-") for r in f.read().strip().split(",")))
    except (OSError, ValueError):
        return 1


def cpu_binding(workers: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` that splits ``cpus`` between the workers (``0|1`` for two on two cores)."""
    per = max(1, len(cpus) // workers)
    return "|".join(",".join(map(str, (cpus[(w * per + i) % len(cpus)] for i in range(per)))) for w in range(workers))


def defaults(stores: list[str], vllm_args: list[str], env: dict, cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The flags and environment the launcher adds to the user's, on a CPU vLLM only, each unless the user
    set it: a KV cache sized by `cpu_kv_cache_bytes` (vLLM's own default reserves a fixed share of all
    memory and refuses to start when other processes hold part of it), and, with more workers than NUMA
    nodes, each worker's own CPUs (vLLM binds one node per worker and refuses otherwise)."""
    if not cpu:
        return [], {}
    workers = (int(flag_value(vllm_args, "--tensor-parallel-size", "-tp") or 1)
               * int(flag_value(vllm_args, "--pipeline-parallel-size", "-pp") or 1))
    args, extra_env = [], {}
    if not env.get(KV_CACHE_ENV) and all(flag_value(vllm_args, flag) is None for flag in KV_CACHE_FLAGS):
        with MiloStore.open(stores[0], tier="disk") as store:  # stores served together are of one model
            layout, positions = store.layout, store.meta["model"]["max_position_embeddings"]
        given = flag_value(vllm_args, "--max-model-len") or ""
        longest = int(given) if given.isdigit() else positions  # "4k", "auto": no longer than the model's
        args = ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes(layout, longest, workers, free_memory_bytes()))]
    if workers > numa_nodes() and not env.get(THREADS_ENV):
        extra_env[THREADS_ENV] = cpu_binding(workers, sorted(os.sched_getaffinity(0)))
    return args, extra_env


# What vLLM's error says when it refuses to start, and what to change. Checked in order; the first match wins.
REFUSALS = (
    (r"Available memory on node .* less than desired CPU memory utilization",
     "drop --gpu-memory-utilization so the launcher sizes the KV cache, or set VLLM_CPU_KVCACHE_SPACE=<GiB> "
     "below the free memory"),
    (r"less than requested memory for kv",
     "set a smaller KV cache (VLLM_CPU_KVCACHE_SPACE=<GiB> or --kv-cache-memory-bytes) or free memory"),
    (r"estimated maximum model length is (\d+)",
     "pass --max-model-len {0} or less, or a larger KV cache (VLLM_CPU_KVCACHE_SPACE=<GiB> or --kv-cache-memory-bytes)"),
    (r"max seq len .* larger than the available KV cache",
     "pass a smaller --max-model-len or a larger KV cache (VLLM_CPU_KVCACHE_SPACE=<GiB> or --kv-cache-memory-bytes)"),
    (r"Not enough allowed NUMA nodes",
     "set VLLM_CPU_OMP_THREADS_BIND to each worker's CPUs, '|' between workers (e.g. 0|1)"),
    (r"must be divisible by tensor parallel size",
     "pass a --tensor-parallel-size that divides the model's attention heads"),
    (r"\[Errno 98\]|address already in use",
     "pass another --port: this one is taken"),
)
ERROR_LINE = re.compile(r"\b(\w+Error|Exception): (.+)")
GENERIC = ("Engine core initialization failed", "See root cause above")  # vLLM's wrappers of the real error


def refusal(output: list[str]) -> str:
    """One line: why vLLM did not start (its own words) and what to change, from the end of its output."""

    def words(line: str) -> str:
        m = ERROR_LINE.search(line)
        said = (m.group(0) if m else line).strip()
        return said if len(said) <= 300 else said[:297] + "..."

    for pattern, change in REFUSALS:
        for line in output:
            if m := re.search(pattern, line, re.IGNORECASE):
                return f"vLLM did not start: {change.format(*m.groups())} (vLLM: {words(line)})"
    errors = [line for line in output if ERROR_LINE.search(line) and not any(g in line for g in GENERIC)]
    said = words(errors[-1]) if errors else (words(output[-1]) if output else "no output")
    return f"vLLM did not start (vLLM: {said}); see its output above"


def run(cmd: list[str], env: dict[str, str]) -> int:
    """Run vLLM, relaying its output, and its exit status; when it fails before it serves, one line on stderr
    says what to change. SIGTERM is passed on; vLLM dies with this process."""
    tail: collections.deque[str] = collections.deque(maxlen=400)
    serving = threading.Event()

    def die_with_parent():
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no vLLM outlives its launcher
        except (OSError, AttributeError):
            pass

    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=die_with_parent)
    handlers = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM)),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}  # a terminal's Ctrl-C reaches vLLM too

    def relay(source, sink):
        for raw in iter(source.readline, b""):
            sink.buffer.write(raw)
            sink.flush()
            line = raw.decode(errors="replace")
            tail.append(line)
            if "Application startup complete" in line:
                serving.set()

    threads = [threading.Thread(target=relay, args=pair, daemon=True)
               for pair in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    for t in threads:
        t.start()
    code = child.wait()
    for t in threads:
        t.join()
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    if code != 0 and not serving.is_set():
        print(f"milo launch: {refusal(list(tail))}", file=sys.stderr)
    return code


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m milo_infer.vllm.launch", description=__doc__.splitlines()[0])
    p.add_argument("store", nargs="+", help="store directories or URLs")
    p.add_argument("--model", default="default", help="the stores' model: 'default', an HF directory or a .gguf")
    p.add_argument("--tier", default="host", choices=("host", "disk", "cached"), help="how the connector mounts them")
    p.add_argument("--load-failure", default="recompute", choices=("recompute", "fail"),
                   help="a request whose blocks cannot be read: vLLM recomputes it (default) or fails it")
    args = p.parse_args(ours)
    import torch

    extra_args, extra_env = defaults(args.store, rest, dict(os.environ), cpu=not torch.cuda.is_available())
    cmd = command(args.store, args.model, args.tier, args.load_failure, tuple(extra_args + rest))
    sys.exit(run(cmd, {**os.environ, **extra_env}))


if __name__ == "__main__":
    main()
