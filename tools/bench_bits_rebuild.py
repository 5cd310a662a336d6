"""Time the rebuild of one block's K/V (every layer) three ways, side by side in one run (issue 45, "the rebuild per
block on the CPU no slower than today's codec at the same ratio"):

- ``bits, from codes``: a bits block rebuilt straight from its stored bytes by `milo_kernels.bits`
  (the codec's `kernel_tables`; on a CPU its plain-PyTorch path, on CUDA the Triton kernel);
- ``bits, host decode + reconstruct``: what a bits store does today, `BitsCodec.decode` into fp16 factors,
  then `milo_kernels.reconstruct_layer`;
- ``int4 low-rank``: today's low-rank codec with INT4 factors at the same ratio (one rank for every unit, the
  largest whose bytes fit ρ of the fp16 K/V), through `reconstruct_layer`.

The block is synthetic (a decaying spectrum in a random basis, keys with a mean), planned by the bits codec's
own allocation at ``--ratio``. Prints milliseconds per block (median of ``--iters``) and each path's ratio to
the INT4 block; ``--threads`` CPU threads (1 on a shared machine).

    python tools/bench_bits_rebuild.py --ratio 0.125 --threads 1
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from milo_infer.bench.throughput import median_seconds  # noqa: E402
from milo_kernels import reconstruct_layer  # noqa: E402
from milo_kernels.bits import reconstruct_bits_layer  # noqa: E402
from milo_store import Layout, factorize_block, full_kv_bytes  # noqa: E402
from milo_store.codecs.lowrank import pack_block  # noqa: E402
from milo_store.codecs import BitsCodec  # noqa: E402


def synthetic_block(L, H, d, T, gen):
    """K and V [L, H, T, d]: a decaying spectrum in a random basis per unit; keys carry a mean."""
    spectrum = torch.exp(-torch.arange(d) / 8.0)
    basis = torch.linalg.qr(torch.randn(L, 2, H, d, d, generator=gen))[0]
    x = (torch.randn(L, 2, H, T, d, generator=gen) * spectrum) @ basis.transpose(-1, -2)
    x[:, 0] += torch.randn(L, H, 1, d, generator=gen)
    return x[:, 0], x[:, 1]


def rebuild_tables(codec, layout):
    """Per layer: block 0's (components, segments) for `milo_kernels.bits`, its rows from 0."""
    return [codec.kernel_tables(0, layer, 0) for layer in range(layout.num_layers)]


def lowrank_segments(layout, ranks, T):
    """Per layer: the segment table of one block (ranks [L, 2, H]) read in place, rows from 0."""
    bounds = layout.layer_offsets(ranks, T)
    return [torch.from_numpy(layout.layer_segments(l, ranks[None, l], [T], [0], [int(bounds[l])]))
            for l in range(layout.num_layers)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=720, help="tokens of the block")
    p.add_argument("--ratio", type=float, default=0.125)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    L, H, d, T = args.layers, args.kv_heads, args.head_dim, args.tokens
    layout, gen = Layout(L, H, d), torch.Generator().manual_seed(args.seed)
    keys, values = synthetic_block(L, H, d, T, gen)
    weights = torch.ones(L, 2, H, d)
    f = factorize_block(keys, values, codec="svd")
    widths, tokens = BitsCodec.plan_widths(lambda i: f, [0], layout, weights, args.ratio)
    codec = BitsCodec(layout, widths, weights, tokens)
    stored = codec.encode(0, f)
    full = full_kv_bytes(layout, np.array([T]))

    int4 = Layout(L, H, d, quant="int4")
    fits = [r for r in range(d + 1) if int4.block_offsets(np.full((1, L, 2, H), r), [T])[-1] <= args.ratio * full]
    rank = max(fits, default=0)
    ranks = np.full((L, 2, H), rank, dtype=np.int64)
    int4_bytes = pack_block(f, ranks, "int4")

    device = torch.device(args.device)
    angles = torch.arange(T)[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d)).repeat(2)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    out = [torch.empty(H, T, d, dtype=torch.float16, device=device) for _ in range(2)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    bits_tables = rebuild_tables(codec, layout)
    scales = [codec.channel_scale(l).to(device) for l in range(L)]
    data = stored.to(device)
    decoded_segments = lowrank_segments(layout, codec.ranks[0], T)
    int4_segments = lowrank_segments(int4, ranks, T)
    int4_data = int4_bytes.to(device)

    def from_codes():
        for l, (components, segments) in enumerate(bits_tables):
            reconstruct_bits_layer(data, components, segments, scales[l], *out, cos, sin)
        sync()

    def host_decode():
        factors = codec.decode(0, stored).to(device)
        for l in range(L):
            reconstruct_layer(factors, decoded_segments[l], *out, cos, sin)
        sync()

    def lowrank_int4():
        for l in range(L):
            reconstruct_layer(int4_data, int4_segments[l], *out, cos, sin, quant="int4")
        sync()

    rows = {"bits, from codes": median_seconds(from_codes, args.iters, warmup=1),
            "bits, host decode + reconstruct": median_seconds(host_decode, args.iters, warmup=1),
            f"int4 low-rank (rank {rank})": median_seconds(lowrank_int4, args.iters, warmup=1)}
    tables_s = median_seconds(lambda: rebuild_tables(codec, layout), args.iters, warmup=1)
    base = rows[f"int4 low-rank (rank {rank})"]
    print(f"block: {L} layers x {H} KV heads, d {d}, {T} tokens; ratio {args.ratio}: bits {stored.numel()} bytes "
          f"({stored.numel() / full:.3f} of fp16, mean stored width {float(widths[widths > 0].mean()):.2f}, "
          f"{int(codec.ranks.sum())} components), int4 {int4_bytes.numel()} bytes ({int4_bytes.numel() / full:.3f}); "
          f"device {args.device}, {args.threads} thread(s)")
    print("| path | ms/block | vs int4 low-rank |\n|---|---:|---:|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / base:.2f} |")
    print(f"(the bits kernel's tables, built once per placement: {tables_s * 1e3:.2f} ms/block, not counted above)")


if __name__ == "__main__":
    main()
