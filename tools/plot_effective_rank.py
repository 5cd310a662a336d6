"""Effective rank of pre-RoPE keys and values against the number of shots (the MILO paper's Figure 1).

From an identity-codec store (the exact K/V of every block): for the first n blocks, stack each
(layer, KV head)'s keys (values) over all their tokens and count the singular directions that hold
99% of the energy; print the mean over layers and heads, and plot it against the demonstrations.
Run: ``.venv/bin/python tools/plot_effective_rank.py STORE [--out effective_rank.png]``.
"""
import argparse

import numpy as np
import torch

from milo_store import MiloStore
from milo_store.codecs.lowrank_reference import reconstruct, unpack_block


def rank_for_energy(x: torch.Tensor, energy: float) -> int:
    s2 = torch.linalg.svdvals(x.double()) ** 2
    return int(torch.searchsorted(torch.cumsum(s2, 0) / s2.sum(), torch.tensor(energy, dtype=torch.float64))) + 1


def block_kv(store: MiloStore, i: int) -> torch.Tensor:
    """Block i's exact K/V [L, 2, H, T, d] from an identity store."""
    lay, t = store.layout, int(store.block_tokens[i])
    out = torch.empty(lay.num_layers, 2, lay.num_kv_heads, t, lay.head_dim)
    for (l, kind, h), A, S, B in unpack_block(store.block(i), lay, store.ranks[i], t):
        out[l, kind, h] = reconstruct(A, S, B)
    return out


def effective_ranks(store: MiloStore, energy: float = 0.99) -> list[dict]:
    if store.meta.get("codec") != "identity" or store.layout.quantized:
        raise ValueError(f"{store.path}: needs an identity-codec store with floating factors (the exact K/V)")
    demos = np.bincount(np.asarray(store.examples()["block"]), minlength=store.num_blocks)
    rows, kv = [], []
    for n in range(1, store.num_blocks + 1):
        kv.append(block_kv(store, n - 1))
        if n & (n - 1):  # powers of two only: 1, 2, 4, ... blocks
            continue
        x = torch.cat(kv, dim=3)
        L, _, H = x.shape[:3]
        ranks = [[rank_for_energy(x[l, kind, h], energy) for l in range(L) for h in range(H)] for kind in (0, 1)]
        rows.append({"blocks": n, "shots": int(demos[:n].sum()), "tokens": x.shape[3],
                     "key": float(np.mean(ranks[0])), "value": float(np.mean(ranks[1]))})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--energy", type=float, default=0.99)
    ap.add_argument("--out", default="effective_rank.png")
    args = ap.parse_args()
    with MiloStore.open(args.store, tier="disk", verify=False) as store:
        rows = effective_ranks(store, args.energy)
        d = store.layout.head_dim
    print(f"| shots | tokens | key rank ({args.energy:.0%} energy) | value rank |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shots']} | {r['tokens']} | {r['key']:.1f} | {r['value']:.1f} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5), constrained_layout=True)
    for kind in ("key", "value"):
        label = "pre-RoPE keys" if kind == "key" else "values"
        ax.plot([r["shots"] for r in rows], [r[kind] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, d)
    ax.set_xlabel("shots (demonstrations)")
    ax.set_ylabel(f"directions for {args.energy:.0%} energy (of {d})")
    ax.legend()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
