"""Relative reconstruction error of one staged block's SVD factors under each A-factor grouping.

Run: ``.venv/bin/python tools/quant_error.py STAGED_BLOCK.safetensors [--layers 0,3,...]``. A staged
block (``stores/staging-*/block_*.safetensors`` of an svd staging) holds full-rank A [L, 2, H, T, n],
S and B; each grouping quantizes A (B at 8 bits per column is common to all), the block is rebuilt
as A diag(S) Bᵀ, and the error is ‖X - X̂‖ / ‖X‖ over the chosen layers and all heads, keys and
values apart. Shows which grouping of the token-indexed factor errs least for its scale bytes.
"""
import argparse

import torch
from safetensors.torch import load_file

from milo_store.codecs.quant import quantize, quantize_token_spans

GROUPINGS = {  # name -> (bits, dim or None for per-column token spans, span tokens)
    "int8, one scale per column": (8, 0, None),
    "int4, one scale per column": (4, 0, None),
    "int4, per column, spans of 128 tokens": (4, None, 128),
    "int4, per column, spans of 32 tokens (keys)": (4, None, 32),
    "int4, per token (values, KIVI)": (4, 1, None),
    "int2, per column, spans of 32 tokens (keys)": (2, None, 32),
    "int2, per token (values, KIVI)": (2, 1, None),
}


def dequantized(a: torch.Tensor, bits: int, dim, span) -> torch.Tensor:
    if span is None:
        codes, scale, low = quantize(a, dim, bits)
        return codes.float() * scale.float().unsqueeze(dim) + low.float().unsqueeze(dim)
    codes, scale, low = quantize_token_spans(a, span, bits)
    of_row = torch.arange(a.shape[0]) // span
    return codes.float() * scale.float()[of_row] + low.float()[of_row]


def errors(path: str, layers: list[int]) -> dict[str, tuple[float, float]]:
    f = load_file(path)
    A, S, B = f["A"].float(), f["S"].float(), f["B"].float()
    Bq = dequantized(B.flatten(0, 2).transpose(0, 1).reshape(B.shape[-2], -1), 8, 0, None)  # per column
    Bq = Bq.reshape(B.shape[-2], *B.shape[:3], B.shape[-1]).permute(1, 2, 3, 0, 4)
    out = {}
    for name, (bits, dim, span) in GROUPINGS.items():
        err = []
        for kind in (0, 1):
            num = den = 0.0
            for l in layers:
                for h in range(A.shape[2]):
                    a, s, b = A[l, kind, h], S[l, kind, h], B[l, kind, h]
                    x = (a * s) @ b.T
                    xq = (dequantized(a, bits, dim, span) * s) @ Bq[l, kind, h].T
                    num, den = num + float((x - xq).norm() ** 2), den + float(x.norm() ** 2)
            err.append((num / den) ** 0.5)
        out[name] = tuple(err)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("block", help="a staged svd block (.safetensors)")
    ap.add_argument("--layers", default=None, help="comma-separated layers (default every third)")
    args = ap.parse_args()
    n_layers = load_file(args.block)["S"].shape[0]
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(range(0, n_layers, 3))
    print("| A-factor grouping | keys | values |\n|---|---:|---:|")
    for name, (k, v) in errors(args.block, layers).items():
        print(f"| {name} | {100 * k:.1f}% | {100 * v:.1f}% |")


if __name__ == "__main__":
    main()
