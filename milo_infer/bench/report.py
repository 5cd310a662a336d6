"""The throughput benchmark's report (`bench.run_bench`) for people: a markdown table and a speedup plot."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .throughput import STAGES


def render_markdown(report: dict) -> str:
    lay = report["layout"]
    lines = [f"model {report['model']} ({lay['num_layers']} layers, {lay['num_kv_heads']} KV heads, d={lay['head_dim']}) "
             f"on {report['device']}, {report['threads']} threads; store {report['store_blocks']} blocks of "
             f"{min(report['block_tokens'])}-{max(report['block_tokens'])} tokens, {report['tier']} tier; "
             f"medians of {report['rounds']} interleaved rounds",
             "",
             "| method | ρ (bytes) | k | batch | q/s | tok/s | retrieve ms | read ms | transfer ms | rebuild ms "
             "| model ms | MiB/query | MiB/query without union | unique blocks | peak K/V MiB | transfer GB/s "
             "| speedup vs full | bound 1/ρ |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        ms = r["ms"]
        lines.append(f"| {r['method']} | {r['ratio']:.3f} | {r['k']} | {r['batch']} | {r['qps']:.2f} | {r['tok_s']:.1f} | "
                     + " | ".join(f"{ms[s]:.1f}" for s in STAGES)
                     + f" | {r['bytes_moved'] / 2**20:.2f} | {r['bytes_without_union'] / 2**20:.2f} | "
                     f"{r['unique_block_share']:.0%} | {r['peak_kv_bytes'] / 2**20:.1f} | {r['transfer_gbps']:.2f} | "
                     f"{r['speedup']:.2f} | "
                     + (f"{1 / r['ratio']:.2f} |" if r["ratio"] else "n/a |"))
    sharing = "blocks held once" if report.get("shared_blocks", True) else "each row its own copy"
    lines += ["", f"per forward (step) and memory; {report['attention']} attention, {sharing}, KV budget "
                  f"{report['kv_budget_bytes'] / 2**20:.0f} MiB, the largest batch that fits: {report['largest_batch']}",
              "", "| method | k | batch | steps | first token ms | transfer ms/step | rebuild ms/step | model ms/step "
                  "| K/V MiB needed | K/V MiB held | blocks held / placed | factors staged MiB | K/V MiB allocated "
                  "| device peak MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        step, peak = r["ms_per_step"], r["device_peak_bytes"]
        lines.append(f"| {r['method']} | {r['k']} | {r['batch']} | {r['steps']:.0f} | {r['first_token_ms']:.1f} | "
                     f"{step['transfer']:.2f} | "
                     f"{step['rebuild']:.2f} | {step['model']:.2f} | {r['kv_bytes_needed'] / 2**20:.1f} | "
                     f"{r['kv_bytes_held'] / 2**20:.1f} | {r['held_blocks']} / {r['placed_blocks']} | "
                     f"{r['staged_bytes'] / 2**20:.1f} | "
                     f"{r['kv_bytes_allocated'] / 2**20:.1f} | " + (f"{peak / 2**20:.0f} |" if peak else "n/a |"))
    if "partial" in report:  # a run still going (or cut short): the figures below come at its end
        lines += ["", f"PARTIAL: {report['partial']}; the transfer path, kernel and crossover figures come at the end"]
        return "\n".join(lines)
    lines += ["", "raw transfer path, same run: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in report["link_gbps"].items())]
    for m, t in report["kernel_s"].items():
        lines.append(f"rebuild of one k={max(r['k'] for r in report['rows'])} retrieval, all layers, {m}: reference "
                     f"{t['reference'] * 1e3:.1f} ms, routed kernel {t['kernel'] * 1e3:.1f} ms "
                     f"({t['reference'] / t['kernel']:.2f}x)")
    fastest = max(report["link_gbps"].values())
    for m, c in report["crossover"].items():
        if c["crossover_gbps"] == float("inf"):
            lines.append(f"crossover {m}: its rebuild is no slower than the full copy, so it wins on any link")
        else:
            verdict = "wins" if fastest < c["crossover_gbps"] else "loses"
            lines.append(f"crossover {m}: saves {c['bytes_saved'] / 2**20:.2f} MiB/query for "
                         f"{c['extra_rebuild_s'] * 1e3:.1f} ms more rebuild; pays off on links slower than "
                         f"{c['crossover_gbps']:.2f} GB/s (this run's fastest path: {fastest:.2f} GB/s, so it {verdict} here)")
    return "\n".join(lines)


def plot(report: dict, path) -> Path | None:
    """Speedup vs ρ per k (batch of the first sweep), with the 1/ρ transfer bound; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report["rows"] if r["method"] not in ("full-gemm", "prefill")]  # prefill moves no bytes
    batch = rows[0]["batch"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    rho = np.linspace(0.15, 1.0, 100)
    ax.plot(rho, 1 / rho, "k--", label="bound 1/ρ (transfer-bound)")
    for k in sorted({r["k"] for r in rows}):
        pts = sorted((r["ratio"], r["speedup"]) for r in rows if r["k"] == k and r["batch"] == batch)
        ax.plot(*zip(*pts), "o-", label=f"measured, k={k}")
    ax.set_xlabel("ρ (bytes moved / full)")
    ax.set_ylabel("queries/s vs full")
    ax.set_title(f"{report['model']} on {report['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
