"""Heatmap of a store's allocated ranks: layer × block, keys and values side by side (mean over KV heads).

Run: ``.venv/bin/python tools/plot_ranks.py STORE [--out ranks.png]``. Shows where the allocation put
the budget: which layers and which blocks kept more directions. A store with raw units (the frontier
policy) gets a second row: the share of raw units, and a raw unit counts as all d directions above.
"""
import argparse

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from milo_store import MiloStore  # noqa: E402
from milo_store.layout import RAW_RANK  # noqa: E402


def plot_ranks(store: MiloStore, out: str) -> str:
    d = store.layout.head_dim
    raw = store.ranks == RAW_RANK
    ranks = np.where(raw, d, store.ranks).astype(float).mean(axis=3)  # [N, L, 2]; raw keeps all d directions
    panels = [(ranks, "rank (mean over KV heads; raw = d)", d, "viridis")]
    if raw.any():
        panels.append((raw.mean(axis=3), "share of raw units", 1, "magma"))
    fig, axes = plt.subplots(len(panels), 2, figsize=(10, 4 * len(panels)), sharey=True, squeeze=False,
                             constrained_layout=True)
    for row, (values, title, top, cmap) in zip(axes, panels):
        for kind, ax in zip((0, 1), row):
            im = ax.imshow(values[:, :, kind].T, aspect="auto", origin="lower", vmin=0, vmax=top, cmap=cmap)
            ax.set_title(f"{('key', 'value')[kind]} {title}")
            ax.set_xlabel("block")
        row[0].set_ylabel("layer")
        fig.colorbar(im, ax=row, label=title.split(" (")[0])
    alloc = store.meta.get("allocation", {})
    fig.suptitle(f"{store.path.name}: ratio {alloc.get('ratio')}, {alloc.get('policy')}, scope {alloc.get('scope')}, "
                 f"{store.dtype}")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--out", default="ranks.png")
    args = ap.parse_args()
    with MiloStore.open(args.store, tier="disk", verify=False) as store:
        print(plot_ranks(store, args.out))


if __name__ == "__main__":
    main()
