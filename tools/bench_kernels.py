"""Time K/V reconstruction: PyTorch reference vs Triton vs Triton replayed from a CUDA graph.

The workload is one model's retrieval (default Qwen2.5-7B-shaped: 28 layers, 4 KV heads, d=128, 6 blocks of
about 1600 tokens, ρ=0.5, so rank ≈ ρ·T·d/(T+d+1) per segment (ρ of the fp16 bytes), jittered ±25% and
capped at d; with --raw-share a share of the segments raw instead, X itself, as the frontier policy stores
them). The same factors packed as INT8/INT4/INT2 (--quant) are timed through the fused kernel too,
each checked against the reference first. Traffic is
counted as factor bytes read plus K/V bytes written; the roofline is a device-to-device copy moving the same
traffic (it reads and writes half of it each), timed in the same run. Host-to-device copies of the factor
bytes, pinned and pageable, show what the offloaded store pays before the kernel starts.

Every checked launch writes into outputs poisoned with NaN, and the script fails unless they come back
finite and equal to the reference (so a kernel that writes nothing fails). GPU: CUDA events, warmup, medians. `--device cpu` runs a small workload with the reference (and the Triton
interpreter when TRITON_INTERPRET=1) so the script itself can be tested without a GPU.
Prints a short table last; writes every number to --out (default $OUT/gpu_check.json, else gpu_check.json).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from milo_format import segment_size  # noqa: E402
from milo_kernels import RAW_RANK, reconstruct_layer, reconstruct_layer_naive  # noqa: E402
from milo_kernels import plan as planning, reconstruct as rk, triton_kernel  # noqa: E402
from milo_store.codecs.quant import pack_raw_segment, pack_segment  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# tiles around the default (64, 16, 32, 8 warps); docs/benchmarks.md lists which of them spill (compile_kernels.py)
SWEEP = [dict(block_t=bt, block_r=br, block_h=bh, num_warps=w)
         for bt in (64, 128) for br in (16, 32) for bh in (32, 64) for w in (4, 8)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--blocks", type=int)
    p.add_argument("--block-tokens", type=int)
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--raw-share", type=float, default=0.0, metavar="P",
                   help="share of segments stored raw (rank -1, X itself; default 0)")
    p.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    p.add_argument("--quant", nargs="*", choices=["int8", "int4", "int2"],
                   help="also time the factors packed in these formats (default: all three on CUDA, none on CPU)")
    p.add_argument("--iters", type=int)
    p.add_argument("--no-sweep", action="store_true", help="skip the Triton tile-size sweep (CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT")
                   else "gpu_check.json")
    args = p.parse_args()
    gpu = args.device == "cuda"
    defaults = dict(layers=28 if gpu else 2, kv_heads=4 if gpu else 2, head_dim=128 if gpu else 64,
                    blocks=6 if gpu else 2, block_tokens=1600 if gpu else 100, iters=20 if gpu else 3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quant is None:
        args.quant = ["int8", "int4", "int2"] if gpu else []
    return args


def build_layer(args, gen):
    """One layer's packed factors, segment table and zeroed outputs; ranks ragged around the ρ target."""
    d, parts, segments, offset, row = args.head_dim, [], [], 0, 0
    for _ in range(args.blocks):
        tokens = int(args.block_tokens * (0.95 + 0.1 * torch.rand((), generator=gen)))
        target = args.rho * tokens * d / (tokens + d + 1)  # r (T + d + 1) = ρ T d values
        for kind in (0, 1):
            for head in range(args.kv_heads):
                rank = min(d, max(1, round(target * (0.75 + 0.5 * float(torch.rand((), generator=gen))))))
                if float(torch.rand((), generator=gen)) < args.raw_share:
                    rank = RAW_RANK
                n = segment_size(rank, tokens, d, 0, kind)
                parts.append(torch.randn(n, generator=gen) * 0.1)
                segments.append([offset, rank, tokens, row, head, kind])
                offset += n
        row += tokens
    dtype, dev = DTYPES[args.dtype], args.device
    factors = torch.cat(parts).to(device=dev, dtype=dtype)
    out = torch.zeros(2, args.kv_heads, row, d, device=dev, dtype=dtype)
    return dict(factors=factors, segments=torch.tensor(segments), out_k=out[0], out_v=out[1])


def rope_tables(n, d, device):
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().to(device), angles.sin().to(device)


def quantized_layer(layer, quant):
    """The same segments packed as `quant` (uint8 bytes, byte offsets), outputs shared with `layer`."""
    d = layer["out_k"].shape[-1]
    flat, parts, table, at = layer["factors"].float().cpu(), [], layer["segments"].clone(), 0
    for i, (src, rank, tokens, _, _, kind) in enumerate(layer["segments"].tolist()):
        if rank == RAW_RANK:
            raw = pack_raw_segment(flat[src:src + tokens * d].view(tokens, d), quant, kind)
        else:
            a_end, s_end = src + tokens * rank, src + tokens * rank + rank
            raw = pack_segment(flat[src:a_end].view(tokens, rank), flat[a_end:s_end],
                               flat[s_end:s_end + d * rank].view(d, rank), quant, kind)
        parts.append(raw)
        table[i, 0] = at
        at += raw.numel()
    return dict(layer, factors=torch.cat(parts).to(layer["factors"].device), segments=table)


def check_against_reference(layer, cos, sin, run, quant=None):
    """Poison the outputs with NaN, run(layer), and return the largest error against the reference; raises
    if an output stays non-finite or differs by more than fp16 staging allows."""
    want = {k: torch.full_like(layer[k], float("nan")) for k in ("out_k", "out_v")}
    reconstruct_layer(layer["factors"], layer["segments"], want["out_k"], want["out_v"], cos, sin, quant=quant,
                      backend="reference")
    for k in want:
        layer[k].fill_(float("nan"))
    run(layer)
    error = 0.0
    for k in want:
        got, ref = layer[k].float(), want[k].float()
        if not bool(got.isfinite().all()):
            raise AssertionError(f"{quant or 'floating'} {k}: {int((~got.isfinite()).sum())} elements not written")
        scale = ref.abs().max().item()  # the workload's outputs are small: tolerances relative to them
        torch.testing.assert_close(got, ref, atol=1e-2 * scale, rtol=1e-2, msg=lambda m: f"{quant or 'floating'} {k}: {m}")
        error = max(error, (got - ref).abs().max().item())
    return error


def timer(device, warmup, iters):
    """Median seconds of fn() after warmup: CUDA events on the GPU, perf_counter on the CPU."""
    def run(fn):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    return run


def layer_bytes(layer):
    out = layer["out_k"]
    return layer["factors"].numel() * layer["factors"].element_size() + 2 * out.numel() * out.element_size()


def graphed(fn):
    """Capture fn() in a CUDA graph (after a warm call on a side stream, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def planned_launches(layers, cos, sin):
    """The query path: every layer planned at once (`plan_layers`, default tiles), then one launch each."""
    first = layers[0]
    plans = planning.plan_layers(torch.stack([L["segments"] for L in layers]), first["out_k"].shape[-1],
                           factor_dtype=first["factors"].dtype, device=first["factors"].device)
    for plan, L in zip(plans, layers):
        rk.launch(plan, L["factors"], L["out_k"], L["out_v"], cos, sin)


def sweep_configs(layers, cos, sin, time_it):
    """Time every tile configuration on all layers; failures (e.g. out of shared memory) are recorded."""
    results = []
    for config in SWEEP:
        try:
            plans = [planning.plan_layer(**L, cos=cos, sin=sin, **config) for L in layers]
            seconds = time_it(lambda: [rk.launch(p, L["factors"], L["out_k"], L["out_v"], cos, sin)
                                       for p, L in zip(plans, layers)])
            results.append({**config, "seconds": seconds})
        except Exception as error:  # a config that does not compile is a result, not a crash
            results.append({**config, "error": f"{type(error).__name__}: {error}"[:300]})
    return results


def main():
    args = parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    layers = [build_layer(args, gen) for _ in range(args.layers)]
    n_rows = layers[0]["out_k"].shape[1]
    cos, sin = rope_tables(max(L["out_k"].shape[1] for L in layers), args.head_dim, args.device)
    gpu = args.device == "cuda"
    triton_ok = triton_kernel.triton is not None and (gpu or (triton_kernel.interpreting() and args.dtype != "bf16"))
    time_it = timer(args.device, warmup=3, iters=args.iters)
    time_slow = timer(args.device, warmup=1, iters=max(3, args.iters // 4))
    scopes = {"layer": layers[:1], "model": layers}
    traffic = {scope: sum(layer_bytes(L) for L in ls) for scope, ls in scopes.items()}
    factor_bytes = {scope: sum(L["factors"].numel() * L["factors"].element_size() for L in ls)
                    for scope, ls in scopes.items()}
    ranks = torch.cat([L["segments"][:, 1] for L in layers]).float()
    factored = ranks[ranks >= 0] if (ranks >= 0).any() else ranks.new_zeros(1)
    report = {
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": getattr(triton_kernel.triton, "__version__", None),
        "workload": {k: getattr(args, k) for k in ("layers", "kv_heads", "head_dim", "blocks", "block_tokens",
                                                   "rho", "raw_share", "dtype")}
        | {"rows_per_layer": n_rows, "segments_per_layer": len(layers[0]["segments"]),
           "rank_mean": factored.mean().item(), "rank_min": factored.min().item(), "rank_max": factored.max().item(),
           "raw_segments": int((ranks == RAW_RANK).sum()),
           "traffic_bytes": traffic, "factor_bytes": factor_bytes,
           "rope_table_bytes": 2 * cos.numel() * cos.element_size()},  # read too, not counted as traffic
        "seconds": {}, "notes": [],
    }
    secs = report["seconds"]
    moved = {}  # bytes each timed row moves, when not its scope's fp traffic

    def each(ls, fn):
        return lambda: [fn(L) for L in ls]

    for scope, ls in scopes.items():
        half = traffic[scope] // 2  # a copy of `half` bytes reads and writes `traffic` bytes in all
        src = torch.empty(half, dtype=torch.uint8, device=args.device)
        dst = torch.empty_like(src)
        secs[f"copy/{scope}"] = time_it(lambda: dst.copy_(src))
        del src, dst
        secs[f"reference/{scope}"] = time_slow(each(ls, lambda L: reconstruct_layer_naive(**L, cos=cos, sin=sin)))

    config = {}
    if triton_ok and gpu and not args.no_sweep:
        report["sweep"] = sweep_configs(layers, cos, sin, time_it)
        ok = [r for r in report["sweep"] if "seconds" in r]
        if ok:
            best = min(ok, key=lambda r: r["seconds"])
            config = {k: best[k] for k in SWEEP[0]}
    report["triton_config"] = config or "default"
    if triton_ok:
        plans = {id(L): planning.plan_layer(**L, cos=cos, sin=sin, **config) for L in layers}

        def launch(L):
            rk.launch(plans[id(L)], L["factors"], L["out_k"], L["out_v"], cos, sin)

        errors = report["max_abs_error_vs_reference"] = {args.dtype: check_against_reference(layers[0], cos, sin, launch)}
        for scope, ls in scopes.items():
            timing = time_it if gpu else time_slow
            secs[f"triton_e2e/{scope}"] = timing(each(ls, lambda L: reconstruct_layer(**L, cos=cos, sin=sin, backend="triton")))
            secs[f"triton_planned/{scope}"] = timing(lambda ls=ls: planned_launches(ls, cos, sin))
            secs[f"triton/{scope}"] = timing(each(ls, launch))
            if gpu:
                secs[f"triton_graph/{scope}"] = time_it(graphed(each(ls, launch)))
        for quant in args.quant:  # the fused kernel on the same factors, packed: fewer bytes read
            packed = [quantized_layer(L, quant) for L in layers]
            qplans = {id(L): planning.plan_layer(**L, cos=cos, sin=sin, quant=quant) for L in packed}

            def qlaunch(L):
                rk.launch(qplans[id(L)], L["factors"], L["out_k"], L["out_v"], cos, sin)

            errors[quant] = check_against_reference(packed[0], cos, sin, qlaunch, quant)
            q_bytes = sum(L["factors"].numel() for L in packed)
            moved[f"triton_{quant}/model"] = traffic["model"] - factor_bytes["model"] + q_bytes
            secs[f"triton_{quant}/model"] = (time_it if gpu else time_slow)(each(packed, qlaunch))
            del packed, qplans
    else:
        report["notes"].append("Triton not timed: needs CUDA, or TRITON_INTERPRET=1 with fp16/fp32 on the CPU")

    if gpu:
        for scope in scopes:
            host = {"pinned": torch.empty(factor_bytes[scope], dtype=torch.uint8, pin_memory=True),
                    "pageable": torch.empty(factor_bytes[scope], dtype=torch.uint8)}
            dst = torch.empty(factor_bytes[scope], dtype=torch.uint8, device="cuda")
            for kind, src in host.items():
                secs[f"h2d_{kind}/{scope}"] = time_slow(lambda: dst.copy_(src, non_blocking=True))
            del host, dst

    for key in secs:
        scope = key.split("/")[1]
        moved.setdefault(key, (factor_bytes if key.startswith("h2d") else traffic)[scope])
    report["gbps"] = {key: moved[key] / s / 1e9 for key, s in secs.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    print(f"full numbers: {args.out}")


def print_table(report):
    secs, gbps = report["seconds"], report["gbps"]
    w = report["workload"]
    print(f"\n{report['device']}: {w['layers']} layers x {w['kv_heads']} kv heads x d={w['head_dim']}, "
          f"{w['blocks']} blocks x ~{w['block_tokens']} tokens, rho={w['rho']}, {w['dtype']}, "
          f"mean rank {w['rank_mean']:.1f} of factored segments, {w['raw_segments']} raw; "
          f"triton config {report['triton_config']}")
    for kind, error in report.get("max_abs_error_vs_reference", {}).items():
        print(f"max |triton - reference| on layer 0, {kind} (outputs poisoned with NaN first): {error:.3g}")
    print(f"{'what':<14}{'scope':>7}{'time':>12}{'GB/s':>10}{'vs copy':>9}{'vs ref':>8}")
    for key, s in secs.items():
        what, scope = key.split("/")
        copy = gbps.get(f"copy/{scope}")
        ref = secs.get(f"reference/{scope}")
        vs_copy = f"{gbps[key] / copy:.0%}" if copy and not what.startswith("h2d") else ""
        vs_ref = f"{ref / s:.1f}x" if ref and what.startswith("triton") and "_int" not in what else ""
        print(f"{what:<14}{scope:>7}{fmt_time(s):>12}{gbps[key]:>10.1f}{vs_copy:>9}{vs_ref:>8}")


def fmt_time(seconds):
    for unit, scale in (("s", 1), ("ms", 1e3)):
        if seconds * scale >= 1:
            return f"{seconds * scale:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


if __name__ == "__main__":
    main()
