"""A real vLLM OpenAI server on loopback with the milo connector, for the tests that need one.

vLLM lives in its own venv (`tools/setup_vllm.sh`: ``.venv-vllm``, or ``$MILO_VLLM_PYTHON``); where there
is none, `vllm_python` skips with the reason. The server imports milo from this checkout, and is started
as a newcomer starts it (`milo_infer.vllm.launch`), so it runs with the launcher's defaults (the CPU KV
cache's size).
"""
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from milo_infer.vllm import launch

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 600  # a cold start on 2 shared cores: model load, then the CPU backend's warm-up


def vllm_python() -> str:
    python = os.environ.get("MILO_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip(f"vLLM is not installed ({python} does not exist): run tools/setup_vllm.sh")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(stores: list, log_path, *, tier: str = "host", max_model_len: int = 4096, model: str = "default",
                eager: bool = True, vllm_args: tuple[str, ...] = (), env: dict | None = None):
    """Yields the base URL of vLLM with the connector over ``stores`` (named by basename) and ``model`` in
    fp32 (so the only rounding between a loaded prefix and vLLM's own is the store's), eager unless told
    (no compilation: a faster start); ``vllm_args`` and ``env`` add to vLLM's flags and environment. The process group is stopped afterwards, whatever
    happened. Prefix caching is off, so a request without the store is a true prefill even after one
    with it."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", **(env or {})}
    env.pop(launch.KV_CACHE_ENV, None)  # the launcher sizes the KV cache, as it does for a newcomer
    vllm_args = ("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
                 str(max_model_len), "--no-enable-prefix-caching",
                 "--enable-prompt-tokens-details", *(("--enforce-eager",) if eager else ()), *vllm_args)
    command = launch.launcher_command(stores, vllm_python(), model=model, tier=tier, vllm_args=vllm_args)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode} while starting:\n{tail(log_path)}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start within {START_TIMEOUT_S} s:\n{tail(log_path)}")
            time.sleep(2)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def tail(path, lines: int = 40) -> str:
    kept = [line for line in Path(path).read_text(errors="replace").splitlines()
            if not line.startswith("WARNING: Location")]  # pip's noise in vLLM's log
    return "\n".join(kept[-lines:])
