"""Accuracy (or agreement with full's answers) of each method against the measured store ratio (the
paper's Figure 5a, and 5d for the allocation policies) or against the block size (Figure 5b), from
`milo eval` results.

Run: ``.venv/bin/python tools/plot_results.py RESULTS.json [MORE.json ...] --x ratio|block_size
[--y accuracy|agreement] [--dataset NAME] [--methods a,b] [--title T] --out fig.png``. Several files
are merged (a row seen twice keeps the last). Points are means over seeds, with the standard deviation
as error bars; with --x ratio a method whose store does not depend on the ratio (``full``) is a dashed
line. Rows without the --y value (full has no agreement with itself) are left out.
"""
import argparse
import json
import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_rows(paths: list[str], dataset: str | None = None, methods: list[str] | None = None) -> list[dict]:
    merged = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for r in json.load(f):
                key = (r["dataset"], r["seed"], r["method"], r.get("ratio_setting"), r.get("block_size"), r.get("k"),
                       r.get("context_blocks"))
                merged[key] = r
    rows = [r for r in merged.values() if (dataset is None or r["dataset"] == dataset)
            and (methods is None or r["method"] in methods)]
    if not rows:
        raise SystemExit("no rows match the given files, --dataset and --methods")
    return rows


def curves(rows: list[dict], x: str, y: str = "accuracy") -> dict[str, list[tuple[float, float, float]]]:
    """Per curve: (x, mean ``y`` %, std over seeds) sorted by x. x is the measured store ratio
    (averaged over seeds) or the block size. A curve is a method, split by every other setting the
    rows vary in (block size or ratio, k, data set), so only seeds are ever averaged. Against block
    size, k goes with the x axis: a fair block-size sweep keeps k × m (the demonstrations in the
    context) fixed, so k changes with m."""
    other = ("ratio_setting", "dataset") if x == "block_size" else ("block_size", "k", "dataset")
    varying = [f for f in other if len({r.get(f) for r in rows}) > 1]
    points = defaultdict(list)
    for r in rows:
        if r.get(y) is None:
            continue
        setting = r.get("block_size") if x == "block_size" else r.get("ratio_setting")
        if setting is None:
            raise SystemExit(f"a row of {r['method']} has no {x}: rerun it with the current milo eval")
        label = r["method"] + "".join(f" {SHORT[f]}={r.get(f)}" for f in varying)
        points[(label, setting)].append(r)
    out = defaultdict(list)
    for (method, setting), rs in points.items():
        accs = [100 * r[y] for r in rs]
        where = setting if x == "block_size" else statistics.fmean(r["store_ratio"] for r in rs)
        out[method].append((where, statistics.fmean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0))
    return {m: sorted(p) for m, p in out.items()}


SHORT = {"ratio_setting": "ρ", "block_size": "m", "k": "k", "dataset": "data"}


def plot(rows: list[dict], x: str, out: str, title: str = "", y: str = "accuracy") -> str:
    fig, ax = plt.subplots(figsize=(6.4, 4.2), constrained_layout=True)
    for method, pts in curves(rows, x, y).items():
        xs, ys, err = zip(*pts)
        if x == "ratio" and len(pts) == 1 and xs[0] > 1:  # a store the ratio does not change (full)
            ax.axhline(ys[0], linestyle="--", color="gray", label=f"{method} ({xs[0]:.2f}×)")
        else:
            ax.errorbar(xs, ys, yerr=err if any(err) else None, marker="o", capsize=3, label=method)
    ax.set_xlabel("store bytes / fp16 K/V bytes (measured)" if x == "ratio" else "demonstrations per block (m)")
    if x == "block_size":
        ax.set_xscale("log", base=2)
    ax.set_ylabel("accuracy (%)" if y == "accuracy" else "answers equal to full's (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    seeds = len({r["seed"] for r in rows})
    ax.set_title(title or f"{', '.join(sorted({r['dataset'] for r in rows}))}: {seeds} seed(s), "
                          f"{rows[0]['n']} queries", fontsize=10)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.json files written by milo eval")
    ap.add_argument("--x", choices=("ratio", "block_size"), default="ratio")
    ap.add_argument("--y", choices=("accuracy", "agreement"), default="accuracy")
    ap.add_argument("--dataset")
    ap.add_argument("--methods", help="comma-separated subset (default: all in the files)")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", default="accuracy.png")
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    print(plot(load_rows(args.results, args.dataset, methods), args.x, args.out, args.title, args.y))


if __name__ == "__main__":
    main()
