"""Heatmap of a store's allocated ranks: layer × block, keys and values side by side (mean over KV heads).

Run: ``.venv/bin/python tools/plot_ranks.py STORE [--out ranks.png]``. Shows where the allocation put
the budget: which layers and which blocks kept more directions.
"""
import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from milo_store import MiloStore  # noqa: E402


def plot_ranks(store: MiloStore, out: str) -> str:
    ranks = store.ranks.astype(float).mean(axis=3)  # [N, L, 2]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True, constrained_layout=True)
    for kind, ax in zip((0, 1), axes):
        im = ax.imshow(ranks[:, :, kind].T, aspect="auto", origin="lower", vmin=0, vmax=store.layout.head_dim,
                       cmap="viridis")
        ax.set_title(f"{('key', 'value')[kind]} rank (mean over KV heads)")
        ax.set_xlabel("block")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, label="rank")
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
