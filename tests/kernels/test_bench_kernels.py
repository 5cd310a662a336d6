"""The GPU check tooling runs where there is no GPU: the benchmark at CPU size, gpu_check.sh as a skip."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_bench_runs_on_cpu_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "tools/bench_kernels.py", "--device", "cpu", "--layers", "1", "--iters", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert {"copy/layer", "reference/layer", "copy/model", "reference/model"} <= set(report["seconds"])
    assert all(v > 0 for v in report["gbps"].values())
    lines = result.stdout.splitlines()  # the table is printed last, then where the JSON went
    assert lines[-2].startswith("reference") and lines[-1] == f"full numbers: {out}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the full check")
def test_gpu_check_skips_without_cuda():
    result = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0
    assert result.stdout.strip().splitlines() == [f"gpu_check: skipped, no CUDA device visible to {sys.executable}"]
