"""The GPU check tooling runs where there is no GPU: the benchmark at CPU size, gpu_check.sh as a skip."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from milo_kernels import reconstruct_layer

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


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", REPO / "tools" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_workload(bench, rho=0.5, raw_share=0.0):
    args = argparse.Namespace(head_dim=64, blocks=6, block_tokens=100, kv_heads=2, rho=rho, raw_share=raw_share,
                              dtype="fp32", device="cpu")
    layer = bench.build_layer(args, torch.Generator().manual_seed(0))
    cos, sin = bench.rope_tables(layer["out_k"].shape[1], 64, "cpu")
    return args, layer, cos, sin


def test_bench_workload_stores_rho_of_the_fp16_values():
    bench = load_bench()
    args, layer, _, _ = small_workload(bench)
    kept = layer["factors"].numel()  # r (T + d + 1) per segment
    full = sum(t * args.head_dim for t in layer["segments"][:, 2].tolist())
    assert 0.4 < kept / full < 0.6  # ranks are jittered ±25% around ρ T d / (T + d + 1)


@pytest.mark.parametrize("quant, raw_share", [(None, 0.0), ("int4", 0.0), (None, 0.5), ("int8", 0.5), ("int4", 0.5)])
def test_bench_check_fails_a_kernel_that_writes_nothing(quant, raw_share):
    """Also with raw segments among factored ones (--raw-share), packed as each format packs them."""
    bench = load_bench()
    _, layer, cos, sin = small_workload(bench, raw_share=raw_share)
    assert ((layer["segments"][:, 1] == -1).sum() > 0) == (raw_share > 0)
    if quant:
        layer = bench.quantized_layer(layer, quant)

    def rebuild(L):  # the CPU path: a correct kernel
        reconstruct_layer(L["factors"], L["segments"], L["out_k"], L["out_v"], cos, sin, quant=quant)

    assert bench.check_against_reference(layer, cos, sin, rebuild, quant) < 1e-3
    with pytest.raises(AssertionError, match="not written"):
        bench.check_against_reference(layer, cos, sin, lambda L: None, quant)

    def wrong(L):
        rebuild(L)
        L["out_v"][0, :3] *= 1.5

    with pytest.raises(AssertionError, match="out_v"):
        bench.check_against_reference(layer, cos, sin, wrong, quant)
