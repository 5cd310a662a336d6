"""`milo eval`'s results as a methods × datasets table (the shape of the MILO paper's Table 1), in
markdown and JSON."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .methods import DEFAULT, fixed_ratio


def write_tables(rows: list[dict], out, *, header: str = "") -> tuple[Path, Path]:
    """``results.json`` (every row) and ``results.md`` (accuracy, methods × datasets) under ``out``.

    A row is one (dataset, seed, block size, method, ratio) with `evaluate`'s fields (its answers
    summarised as ``agreement``). A table row is a method, labelled with its ratio and block size where
    the rows hold several; a cell is the mean accuracy over seeds (± the standard deviation when there
    are several), then in brackets the mean share of answers equal to ``full``'s on the same items
    where a row has one. The bytes columns are the stores' measured size over the fp16 K/V of the
    same tokens, and the mean bytes a query streamed.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(_label(r, rows) for r in rows))
    lines = [header] if header else []
    lines += ["| Method | " + " | ".join(datasets) + " | Avg. | Store / full fp16 | Query KV read (mean) |",
              "|---" * (len(datasets) + 4) + "|"]
    for m in methods:
        mine = [r for r in rows if _label(r, rows) == m]
        cells, means = [], []
        for d in datasets:
            accs = [100 * r["accuracy"] for r in mine if r["dataset"] == d]
            agree = [100 * r["agreement"] for r in mine if r["dataset"] == d and r.get("agreement") is not None]
            if accs:
                means.append(statistics.fmean(accs))
                spread = f" ± {statistics.stdev(accs):.1f}" if len(accs) > 1 else ""
                agreed = f" [{statistics.fmean(agree):.0f}%]" if agree else ""
                cells.append(f"{means[-1]:.1f}{spread}{agreed}")
            else:
                cells.append("–")
        avg = f"{statistics.fmean(means):.1f}" if len(means) == len(datasets) else "–"
        ratio = sum(r["store_bytes"] for r in mine) / sum(r["store_full_fp16_bytes"] for r in mine)
        read = statistics.fmean(r["query_kv_bytes_stored"] for r in mine)
        full = statistics.fmean(r["query_kv_bytes_full"] for r in mine)
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {avg} | {ratio:.3f} ({1 / ratio:.2f}× smaller) | "
                     f"{_mib(read)} of {_mib(full)} fp16 |")
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md_path, json_path


def _label(row: dict, rows: list[dict]) -> str:
    """The method's name, plus its ratio and block size where the rows hold more than one of each."""
    label = row["method"] if row["method"] != DEFAULT else f"default = {row['resolved']}"
    def scaled(r):  # a method whose store changes with the ratio
        return not fixed_ratio(r.get("resolved", r["method"]))
    if scaled(row) and len({r.get("ratio_setting") for r in rows if scaled(r)}) > 1:
        label += f" ρ={row['ratio_setting']:g}"
    if len({r.get("block_size") for r in rows}) > 1:
        label += f" m={row.get('block_size')}"
    return label


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"
