"""`milo bench` at tiny size: a random Qwen2 model, synthetic stores, the whole pipeline, in seconds."""
import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from milo_infer.bench import synthetic_model, throughput
from milo_infer.bench.report import plot, render_markdown
from milo_infer.cli import bench as cli
from milo_infer.runtime.session import MiloSession
from milo_infer.runtime.planning import EngineSettings
from milo_kernels import reconstruct_layer
from milo_store import Layout, MiloStore, factorize_block, pack_block
from milo_store.layout import full_kv_bytes
from milo_store.synthetic import synthetic_block_kv
from tests.infer.runtime.test_engine import expected_peak_kv_bytes

REPO = Path(__file__).resolve().parents[3]
COLUMNS = ["method", "ρ (bytes)", "k", "batch", "q/s", "tok/s", "retrieve ms", "read ms", "transfer ms",
           "rebuild ms", "model ms", "MiB/query", "MiB/query without union", "unique blocks", "peak K/V MiB",
           "transfer GB/s", "speedup vs full", "bound 1/ρ"]


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """(model, store paths, queries) of the tiny synthetic benchmark."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("bench")
    loaded = synthetic_model.random_model("tiny")
    paths = synthetic_model.synthetic_stores(root, loaded, demos=48, block_size=8, demo_tokens=12, ratios=(0.5, 0.25))
    return loaded, paths, synthetic_model.synthetic_queries(2, 6, 4)


@pytest.fixture(scope="module")
def report(workload):
    """One run of every method; one torch thread (two contend badly on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        partial = []
        report = throughput.run_bench(*workload, ks=(2, 4), batches=(1, 2), rounds=2, progress=lambda _: None,
                                      on_batch=lambda r: partial.append((r, render_markdown(r))))
        yield {**report, "partial_reports": partial}
    finally:
        torch.set_num_threads(threads)


def test_every_method_k_and_batch_is_measured(report):
    """A row per (method, k, batch), whose stage times are disjoint parts of its wall time; the link and kernel
    figures of the report's device."""
    rows = report["rows"]
    assert {(r["method"], r["k"], r["batch"]) for r in rows} == {
        (m, k, b) for m in ("full", "full-gemm", "milo-r0.5", "milo-r0.25") for k in (2, 4) for b in (1, 2)}
    cuda = report["device"].startswith("cuda")
    overlapping = {"transfer"} if cuda else set()  # on CUDA the copies run on a side stream, under the model
    assert report["rounds"] == 2  # a median of two is their mean: per-query stage medians add up like the rounds
    for r in rows:
        assert r["qps"] > 0 and r["transfer_gbps"] > 0
        assert r["tokens_per_query"] == 5  # " cNN" + newline, label-constrained
        assert set(r["ms"]) == set(throughput.STAGES) and all(v >= 0 for v in r["ms"].values())
        assert r["ms"]["model"] > 0
        assert sum(v for stage, v in r["ms"].items() if stage not in overlapping) <= 1e3 / r["qps"]
    assert set(report["link_gbps"]) == ({"H2D pinned", "H2D pageable"} if cuda else {"memcpy", "preadv (page cache)"})
    assert all(v > 0 for v in report["link_gbps"].values())
    assert set(report["kernel_s"]) == {"milo-r0.5", "milo-r0.25"}
    for times in report["kernel_s"].values():
        assert set(times) == {"reference", "kernel"} and all(t > 0 for t in times.values())


def test_a_report_is_handed_on_after_each_batch(report):
    """A run cut short (the H200's first sweep hit its timeout, 2026-12-04) leaves what it measured: after each
    (k, batch), the rows so far, rendered with a line saying the run is partial."""
    partial = report["partial_reports"]
    assert [r["partial"] for r, _ in partial] == [f"{n} of 4 (k, batch) measured" for n in (1, 2, 3, 4)]
    assert [len(r["rows"]) for r, _ in partial] == [4, 8, 12, 16]
    assert partial[-1][0]["rows"] == report["rows"]
    for r, md in partial:
        assert "link_gbps" not in r and md.count("| milo-r0.5 |") == 2 * len(r["rows"]) // 4
        assert md.endswith(f"PARTIAL: {r['partial']}; the transfer path, kernel and crossover figures come at the end")


def test_each_rows_figures_come_from_one_measurement(report):
    """The rates share one wall time, the transfer rate is the bytes over the transfer stage, and speedup and
    ratio are against the full method of the same k and batch."""
    rows = {(r["method"], r["k"], r["batch"]): r for r in report["rows"]}
    for (method, k, batch), r in rows.items():
        full = rows[("full", k, batch)]
        assert r["tok_s"] / r["qps"] == pytest.approx(r["tokens_per_query"])
        assert r["transfer_gbps"] == pytest.approx(r["bytes_moved"] / (r["ms"]["transfer"] / 1e3) / 1e9)
        assert r["speedup"] == pytest.approx(r["qps"] / full["qps"])
        assert r["ratio"] == pytest.approx(r["bytes_moved"] / full["bytes_moved"])
        assert r["queries"] == 2 and len(r["answers"]) == 2


def test_bytes_moved_are_the_retrieved_blocks_bytes_in_the_store(report, workload):
    """Measured, not modelled: each row's bytes are those of the blocks its queries retrieve, read from the store."""
    loaded, paths, queries = workload
    for r in report["rows"]:
        with MiloStore.open(paths[throughput.store_of(r["method"])], tier="host") as store:
            session = MiloSession(loaded, store, settings=EngineSettings(k=r["k"]))
            blocks = [session.select(q) for q in queries]
            size = lambda b: int(store.offsets[b + 1] - store.offsets[b]) * store.itemsize  # noqa: E731
            own = [sum(size(b) for b in chosen) for chosen in blocks]
            full = [full_kv_bytes(store.layout, store.block_tokens[chosen]) for chosen in blocks]
            chunks = [blocks[i:i + r["batch"]] for i in range(0, len(blocks), r["batch"])]
            union = sum(size(b) for chunk in chunks for b in set().union(*chunk))  # a batch reads each block once
            unique = sum(len(set().union(*chunk)) for chunk in chunks)
        assert all(len(chosen) == r["k"] for chosen in blocks)
        assert r["unique_block_share"] == unique / (r["k"] * len(queries))
        assert r["bytes_without_union"] == statistics.mean(own) and r["bytes_full_kv"] == statistics.mean(full)
        assert abs(r["bytes_moved"] - union / len(queries)) <= 1  # each answer's share, rounded down


def test_bytes_are_measured_and_compressed_stores_move_fewer(report):
    for r in report["rows"]:
        # a batch fetches the union of its rows' blocks: alone, a query moves all of its own
        assert r["bytes_moved"] <= r["bytes_without_union"] and 0 < r["unique_block_share"] <= 1
        if r["batch"] == 1:
            assert r["bytes_moved"] == r["bytes_without_union"] and r["unique_block_share"] == 1
        if r["method"].startswith("full"):
            # identity also moves Σ = 1, B = I
            assert r["ratio"] == 1.0 and r["bytes_without_union"] > r["bytes_full_kv"]
        else:
            target = float(r["method"].removeprefix("milo-r"))
            assert r["ratio"] < 1.0 and r["bytes_without_union"] < 1.2 * target * r["bytes_full_kv"]
    c = report["crossover"]
    assert set(c) == {"milo-r0.5", "milo-r0.25"} and all(v["bytes_saved"] > 0 for v in c.values())


def test_peak_kv_bytes_are_the_largest_batchs_cache_and_staged_factors(report, workload):
    """A row's peak K/V bytes are those of its largest batch (queries answered ``batch`` at a time), exactly."""
    loaded, paths, queries = workload
    for r in report["rows"]:
        with MiloStore.open(paths[throughput.store_of(r["method"])], tier="host") as store:
            session = MiloSession(loaded, store, EngineSettings(k=r["k"]))
            chunks = [queries[i:i + r["batch"]] for i in range(0, len(queries), r["batch"])]
            peaks = [expected_peak_kv_bytes(session.engine, [session.plan(q) for q in chunk],
                                            decoded=r["method"] != "full")  # the copy baseline decodes nothing
                     for chunk in chunks]
        assert r["peak_kv_bytes"] == max(peaks), (r["method"], r["k"], r["batch"])


def test_full_copy_and_full_gemm_answer_alike(report):
    """The copy baseline fills the cache with the K/V the kernel rebuilds from the identity store."""
    rows = {(r["method"], r["k"], r["batch"]): r["answers"] for r in report["rows"]}
    for k in (2, 4):
        assert rows[("full", k, 1)] == rows[("full-gemm", k, 1)]


def test_copy_identity_layer_equals_the_kernel_on_an_identity_block():
    layout = Layout(1, 2, 16)
    k, v = synthetic_block_kv(layout, 9, torch.Generator().manual_seed(1))
    f = factorize_block(k, v, codec="identity")
    factors = pack_block(f, torch.full((1, 2, 2), 16).numpy(), "float32")
    segments = torch.from_numpy(layout.layer_segments(0, torch.full((1, 2, 2), 16).numpy(), [9], [3], [0]))
    angles = torch.arange(12.0)[:, None] * torch.rand(16)
    cos, sin = angles.cos(), angles.sin()
    outs = []
    for fn in (reconstruct_layer, throughput.copy_identity_layer):
        out = [torch.full((2, 12, 16), math.nan) for _ in range(2)]
        fn(factors, segments, *out, cos, sin)
        outs.append(out)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, equal_nan=True, atol=1e-5, rtol=1e-5)


def test_per_step_times_and_kv_bytes_are_the_runs_own(report):
    """Per forward: the same stage seconds over the batches' forwards; the pools' bytes: the rows' columns
    rounded up to pages (each held block's once, rounded up itself, and held blocks kept for later rows besides),
    so at least those columns and whole pages."""
    from milo_infer.runtime.pages import PAGE_TOKENS

    for r in report["rows"]:
        assert r["steps"] >= math.ceil(r["queries"] / r["batch"]) * r["tokens_per_query"]  # one forward per token
        for stage in throughput.STAGES:
            assert r["ms_per_step"][stage] * r["steps"] == pytest.approx(r["ms"][stage] * r["queries"])
        lay = report["layout"]
        itemsize = 2 if report["device"].startswith("cuda") else 4
        page = PAGE_TOKENS * 2 * lay["num_layers"] * lay["num_kv_heads"] * lay["head_dim"] * itemsize
        held = 1 + report["store_blocks"] if report["shared_blocks"] else 0  # an anchor, blocks: a page each at most
        assert 0 < r["kv_bytes_needed"] <= r["kv_bytes_allocated"] < r["kv_bytes_needed"] + page * (r["batch"] + held)
        assert 0 < r["kv_bytes_held"] <= r["kv_bytes_allocated"] and r["held_blocks"] <= r["placed_blocks"]
        assert r["kv_bytes_allocated"] % page == 0
        assert r["device_peak_bytes"] is None or r["device_peak_bytes"] >= r["kv_bytes_allocated"]
    assert report["attention"] == ("flex" if report["device"].startswith("cuda") else "rows")


def test_markdown_table_has_the_columns_and_one_line_per_row(report, tmp_path):
    md = render_markdown(report)
    header = next(line for line in md.splitlines() if line.startswith("| method"))
    assert [c.strip() for c in header.strip("|").split("|")] == COLUMNS
    # each row twice: its throughput and stages, then per step and memory
    assert sum(line.startswith("| ") and not line.startswith("| method") for line in md.splitlines()) == 2 * len(report["rows"])
    assert "raw transfer path, same run: memcpy" in md and "crossover milo-r0.25" in md
    pytest.importorskip("matplotlib")
    assert plot(report, tmp_path / "b.png").stat().st_size > 0


def test_cli_synthetic_run_writes_reports(tmp_path):
    """The entry tools/gpu_bench.sh runs, at a tiny shape on CPU."""
    code = cli.main(["--synthetic", "tiny", "--shots", "16", "--block-size", "8", "--demo-tokens", "8",
                     "--k", "2", "--batch", "1", "--n-queries", "1", "--rounds", "1", "--ratios", "0.5",
                     "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["command"] and [r["method"] for r in report["rows"]] == ["full", "full-gemm", "milo-r0.5"]
    assert (tmp_path / "bench.md").read_text().count("| milo-r0.5 |") == 2  # its throughput row and its per-step row


@pytest.mark.parametrize("argv, message", [
    (["--ratios", "1.5"], "--ratios"), (["--k", "0"], "--k"), (["--batch", "x"], "--batch"),
    (["--corpus", "c.jsonl"], "--corpus needs --queries"), (["--threads", "0"], "--threads must be at least 1; got 0"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    assert cli.main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_the_gpu_sweep_runs_on_the_cpu_at_tiny_shapes(tmp_path):
    """tools/gpu_bench.sh --device cpu: the four parts the GPU runs, at tiny shapes (~70 s here): the decode step's op
    profile, milo bench at batches 1, 2 and the largest that fits the KV budget (shared blocks) with the prefill
    method, the distinct-block regime (64 blocks, batches 4 and 8), then milo serve over the ρ 0.5 store with the
    random model, each level twice."""
    result = subprocess.run(["bash", "tools/gpu_bench.sh", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                            timeout=900, env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = tmp_path / "gpu_bench"
    profile = json.loads((reports / "profile.json").read_text())
    assert [r["rows"] for r in profile["reports"]] == [1, 2] and "longest host gaps" in (reports / "profile.txt").read_text()
    report = json.loads((reports / "throughput-on" / "bench.json").read_text())
    largest = report["largest_batch"]
    assert largest > 2 and report["kv_budget_bytes"] == 4 << 20
    methods = ("full", "full-gemm", "prefill", "milo-r0.5")
    assert {(r["method"], r["batch"]) for r in report["rows"]} == {(m, b) for m in methods for b in (1, 2, largest)}
    assert all(r["kv_bytes_allocated"] <= 4 << 20 and r["first_token_ms"] > 0 for r in report["rows"])
    assert all(r["bytes_moved"] == 0 for r in report["rows"] if r["method"] == "prefill")
    distinct = json.loads((reports / "distinct" / "bench.json").read_text())
    assert distinct["store_blocks"] == 64 and {(r["method"], r["batch"]) for r in distinct["rows"]} == {
        (m, b) for m in methods for b in (4, 8)}
    served = json.loads((reports / "serve.json").read_text())
    assert [s["store"] for s in served] == ["milo-r0.5"] and all(s["exit_status"] == 0 for s in served)
    assert 0 < served[0]["warmup_s"] < served[0]["ready_s"]  # --warmup all: the server warmed before /health's 200
    assert served[0]["shared_blocks"] == "on" and all(lv["held_blocks"] <= lv["placed_blocks"]  # sampled: may see none
                                                     for lv in served[0]["levels"])
    levels = served[0]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["qps"] > 0 < lv["repeat_qps"] for lv in levels)
    assert all(lv["sampled_qps"] > 0 < lv["sampled_tokens_per_s"] for lv in levels)  # sampled, top-5 logprobs
    assert all(lv["compiled_after_warmup"] == 0 for lv in levels)  # the CPU's per-row attention compiles nothing


def test_the_hybrid_and_conformance_parts_run_on_the_cpu(tmp_path):
    """tools/gpu_bench.sh --device cpu, PARTS="hybrid conformance" (issue 72): a tiny Qwen3.5's decode step's linear
    layers at 1 and 2 rows, milo bench over its stores at batches 1 and 2 with the prefill method, and the conformance
    suite over LFM2's tiny model, each report written."""
    result = subprocess.run(["bash", "tools/gpu_bench.sh", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                            timeout=900, env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path),
                                              "PARTS": "hybrid conformance"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = tmp_path / "gpu_bench"
    linear = json.loads((reports / "linear_rows.json").read_text())
    assert linear["shape"] == "qwen3.5-tiny" and [r["rows"] for r in linear["results"]] == [1, 2]
    report = json.loads((reports / "hybrid" / "bench.json").read_text())
    assert {(r["method"], r["batch"]) for r in report["rows"]} == {
        (m, b) for m in ("full", "full-gemm", "prefill", "milo-r0.5") for b in (1, 2)}
    assert " passed" in (reports / "conformance.txt").read_text() and "failed" not in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the full benchmark")
def test_gpu_bench_skips_without_cuda():
    result = subprocess.run(["bash", "tools/gpu_bench.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0 and result.stdout.strip() == "gpu_bench: skipped, no CUDA device visible to " + sys.executable


def test_a_synthetic_model_spec_is_the_shape_the_bench_builds_stores_for():
    """`milo serve --model synthetic:SHAPE` serves what `milo bench --synthetic SHAPE` built: same identity."""
    from milo_infer.cli import CommandError, load_model_arg

    loaded = load_model_arg("synthetic:tiny")
    assert loaded.identity == synthetic_model.random_model("tiny").identity
    assert next(loaded.model.parameters()).dtype == torch.float32
    with pytest.raises(CommandError, match="--model synthetic:nope: no such shape .*qwen2.5-7b"):
        load_model_arg("synthetic:nope")


def bench_serve_module():
    spec = importlib.util.spec_from_file_location("bench_serve", REPO / "tools" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_server_that_does_not_start_says_why(tmp_path, monkeypatch):
    """bench_serve shows the tail of a failed server's stderr (the H200's first run said only "exit 1"), and the
    server keeps the caller's PYTHONPATH (where gpu_bench.sh puts the wheels the GPU image lacks) after the checkout."""
    bench_serve = bench_serve_module()
    monkeypatch.setenv("PYTHONPATH", "/carried/wheels")
    assert bench_serve.server_env()["PYTHONPATH"] == f"{REPO}{os.pathsep}/carried/wheels"
    args = argparse.Namespace(max_batch=2, batch_wait_ms=5.0, model="synthetic:tiny", k=2, device="cpu",
                              kv_cache_memory=None, attention="auto", threads=1, start_timeout=120, warmup=None,
                              warmup_rows=None)
    with pytest.raises(SystemExit, match=r"(?s)did not start \(exit 2\); its stderr ends:\n.*no-such-store"):
        bench_serve.start_server(str(tmp_path / "no-such-store"), args)
