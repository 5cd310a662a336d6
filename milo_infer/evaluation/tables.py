"""`milo eval`'s results as a methods × datasets table (the shape of the MILO paper's Table 1), in
markdown and JSON."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .methods import DEFAULT, PREFILL, fixed_ratio


def write_tables(rows: list[dict], out, *, header: str = "") -> tuple[Path, Path]:
    """``results.json`` (every row) and ``results.md`` (accuracy, methods × datasets) under ``out``.

    A row is one (dataset, seed, block size, method, ratio) with `evaluate`'s fields (its answers
    summarised as ``agreement``). A table row is a method, labelled with its ratio and block size where
    the rows hold several; a cell is the mean accuracy over seeds (± the standard deviation when there
    are several), then in brackets the mean share of answers equal to ``full``'s on the same items
    where a row has one, and where any row has one the share equal to ``prefill``'s after it
    (``[98% · 91%]``). The bytes columns are the stores' measured size over the fp16 K/V of the
    same tokens, and the mean bytes a query streamed; the last two the mean time to first token and
    tokens the model prefilled per query (``–`` for predictions logged before they were).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(_label(r, rows) for r in rows))
    lines = [header] if header else []
    with_prefill = any(r.get("agreement_prefill") is not None for r in rows)
    lines += ["| Method | " + " | ".join(datasets) + " | Avg. | Store / full fp16 | Query KV read (mean) | "
              "First token (mean) | Tokens prefilled (mean) |",
              "|---" * (len(datasets) + 6) + "|"]
    for m in methods:
        mine = [r for r in rows if _label(r, rows) == m]
        cells, means = [], []
        for d in datasets:
            accs = [100 * r["accuracy"] for r in mine if r["dataset"] == d]
            here = [r for r in mine if r["dataset"] == d]
            agreed = _agreements(here, with_prefill)
            if accs:
                means.append(statistics.fmean(accs))
                spread = f" ± {statistics.stdev(accs):.1f}" if len(accs) > 1 else ""
                cells.append(f"{means[-1]:.1f}{spread}{agreed}")
            else:
                cells.append("–")
        avg = f"{statistics.fmean(means):.1f}" if len(means) == len(datasets) else "–"
        ratio = sum(r["store_bytes"] for r in mine) / sum(r["store_full_fp16_bytes"] for r in mine)
        read = statistics.fmean(r["query_kv_bytes_stored"] for r in mine)
        full = statistics.fmean(r["query_kv_bytes_full"] for r in mine)
        stored = ("no store | none (the model prefills)" if mine[0]["method"] == PREFILL else
                  f"{ratio:.3f} ({1 / ratio:.2f}× smaller) | {_mib(read)} of {_mib(full)} fp16")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {avg} | {stored} | "
                     f"{_measured(mine, 'first_token_seconds', '{:.2f} s')} | {_measured(mine, 'prefill_tokens', '{:,.0f}')} |")
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md_path, json_path


def _label(row: dict, rows: list[dict]) -> str:
    """The method's name, plus its ratio, block size and context blocks where the rows hold more than one
    of each (prefill's rows have no context blocks: they do not depend on them)."""
    label = row["method"] if row["method"] != DEFAULT else f"default = {row['resolved']}"
    def scaled(r):  # a method whose store changes with the ratio
        return not fixed_ratio(r.get("resolved", r["method"]))
    if scaled(row) and len({r.get("ratio_setting") for r in rows if scaled(r)}) > 1:
        label += f" ρ={row['ratio_setting']:g}"
    if len({r.get("block_size") for r in rows}) > 1:
        label += f" m={row.get('block_size')}"
    if row.get("context_blocks") is not None and len({r.get("context_blocks") for r in rows} - {None}) > 1:
        label += f" w={row['context_blocks']}"
    return label


def _agreements(rows: list[dict], with_prefill: bool) -> str:
    """`` [full's %]``, or `` [full's % · prefill's %]`` where the table has prefill agreements; '' if none."""
    def share(field):
        values = [100 * r[field] for r in rows if r.get(field) is not None]
        return f"{statistics.fmean(values):.0f}%" if values else "–"
    if not with_prefill:
        return f" [{share('agreement')}]" if share("agreement") != "–" else ""
    return f" [{share('agreement')} · {share('agreement_prefill')}]"


def _measured(rows: list[dict], field: str, form: str) -> str:
    """The mean of a per-query mean over the rows that measured it, else '–'."""
    values = [r[field] for r in rows if r.get(field) is not None]
    return form.format(statistics.fmean(values)) if values else "–"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"
