"""End-to-end throughput of answering from offloaded K/V: full-KV offload against MILO (issue 7).

Every method answers the same queries through `MiloSession` (retrieve k blocks, read their factors,
move them to the compute device, rebuild K/V, prefill the query and decode a label), from stores of
one encoding whose bytes are measured, never computed:

* ``full``: the identity-codec fp16 store with its K/V *copied* into the cache and keys rotated, the
  work a full-KV offload does; ``full-gemm``: the same store rebuilt by the kernel as X·I (what the
  unmodified pipeline does with an identity store, kept to show what that costs);
* ``milo-r<ρ>``: SVD factors at ratio ρ, rebuilt by `milo_kernels.reconstruct_layer`.

Methods run interleaved, round after round, and each figure is the median over rounds, so drifting
load on a shared machine hits all methods alike. Beside them, in the same run: the raw bandwidth of
the transfer path (memcpy and page-cache preadv on CPU, pinned and pageable H2D on CUDA) and the
rebuild time of one retrieval by the literal reference vs the routed kernel. From these the report
derives the bound on speedup (the bytes ratio, ≈ 1/ρ) and the crossover: the link bandwidth below
which moving fewer bytes pays for the extra reconstruction.

`synthetic_setup` makes the same workload without a real model or corpus (random weights of a given
shape, a byte-level tokenizer, synthetic K/V), for tests and GPU runs without downloads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from milo_kernels import reconstruct_layer
from milo_kernels.cpu import rope
from milo_store import CompressionConfig, Layout, MiloStore, Staging, factorize_block, write_store
from milo_store.prefetch import LayerPrefetcher
from milo_store.synthetic import synthetic_block_kv

from .corpus import Demonstration, TaskSpec
from .models import LoadedModel, model_identity
from .session import MiloSession

STAGES = ("retrieve", "read", "transfer", "rebuild", "model")


# --- the timed pipeline --------------------------------------------------------------------------

class TimedSession(MiloSession):
    """`MiloSession` for the benchmark: ``copy_identity`` replaces the rebuild of an identity store by a
    copy (the full-KV baseline). Stage times come from the engine (CUDA events on CUDA)."""

    def __init__(self, loaded, store, *, copy_identity: bool = False, **kwargs):
        if copy_identity and store.meta.get("codec") != "identity":
            raise ValueError(f"{store.path}: copy_identity needs an identity-codec store")
        super().__init__(loaded, store, **({"rebuild": copy_identity_layer} if copy_identity else {}), **kwargs)


def copy_identity_layer(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, **_) -> None:
    """The full-KV baseline's fill: an identity segment's A is X itself, so per kind gather every segment's
    rows in one cat, rotate the keys, and scatter all rows to their (head, row) in one indexed write: a
    handful of launches a layer, as a real offload's copy would be."""
    d = out_k.shape[-1]
    segs = segments.cpu()
    for kind, out in ((0, out_k), (1, out_v)):
        mine = segs[segs[:, 5] == kind]
        if not len(mine):
            continue
        src, _, tokens, dst, head, _ = mine.unbind(1)
        x = torch.cat([factors[s:s + t * d].view(t, d) for s, t in zip(src.tolist(), tokens.tolist())])
        within = torch.arange(int(tokens.sum())) - torch.repeat_interleave(torch.cumsum(tokens, 0) - tokens, tokens)
        where = torch.stack([torch.repeat_interleave(dst, tokens) + within, torch.repeat_interleave(head, tokens)])
        if out.is_cuda:  # a pageable upload would wait for the compute stream, every layer
            where = where.pin_memory().to(out.device, non_blocking=True)
        rows, heads = where
        if kind == 0:
            x = rope(x.float(), cos[rows], sin[rows], interleaved)
        out[heads, rows] = x.to(out.dtype)


# --- methods and stores --------------------------------------------------------------------------

def method_names(ratios) -> list[str]:
    return ["full", "full-gemm"] + [f"milo-r{r:g}" for r in ratios]


def store_configs(ratios) -> dict[str, CompressionConfig]:
    """Store directory name -> configuration: one identity store serves both full methods."""
    configs = {"full": CompressionConfig(codec="identity", ratio=1.0, dtype="float16")}
    configs.update({f"milo-r{r:g}": CompressionConfig(codec="svd", ratio=r, dtype="float16") for r in ratios})
    return configs


def store_of(method: str) -> str:
    return "full" if method.startswith("full") else method


def real_stores(root, loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, ratios,
                block_size: int = 32, context_blocks: int = 2) -> dict[str, Path]:
    """Build (or reuse) every method's store from one encoding of ``demos``."""
    from .build import BuildConfig
    from .evaluate import encode_once

    base = BuildConfig(block_size=block_size, context_blocks=context_blocks)
    summaries = encode_once(loaded, demos, task, base, store_configs(ratios), root, progress=False)
    return {name: Path(s["store"]) for name, s in summaries.items()}


# --- measuring -----------------------------------------------------------------------------------

def measure(sessions: dict[str, TimedSession], queries: list[str], k: int, batch: int, rounds: int) -> list[dict]:
    """One row per method: medians over ``rounds`` of the same queries, methods interleaved."""
    samples = {name: [] for name in sessions}
    chunks = [queries[i:i + batch] for i in range(0, len(queries), batch)]
    for _ in range(rounds):
        for name, s in sessions.items():
            s.k = k
            answers, t = [], time.perf_counter()
            for chunk in chunks:
                answers += s.answer_batch(chunk)
            wall = time.perf_counter() - t
            samples[name].append((wall, sum(a.completion_tokens for a in answers), answers))
    rows = []
    for name, runs in samples.items():
        n = len(queries)
        per_query = {stage: [] for stage in STAGES}
        for _, _, answers in runs:
            sec = [a.seconds for a in answers]
            for stage, values in (("retrieve", [x["retrieve"] for x in sec]), ("read", [x["read"] for x in sec]),
                                  ("transfer", [x["transfer"] for x in sec]),
                                  ("rebuild", [x["reconstruct"] for x in sec]),
                                  ("model", [x["model"] for x in sec])):
                per_query[stage].append(sum(values) / n)
        answers = runs[0][2]
        moved = statistics.mean(a.kv_bytes_stored for a in answers)
        transfer = statistics.median(per_query["transfer"])
        wall = statistics.median(r[0] for r in runs)
        rows.append({
            "method": name, "k": k, "batch": batch, "queries": n,
            "qps": n / wall, "tok_s": statistics.median(r[1] for r in runs) / wall,
            "tokens_per_query": statistics.median(r[1] for r in runs) / n,
            "ms": {stage: 1e3 * statistics.median(v) for stage, v in per_query.items()},
            "bytes_moved": moved, "bytes_full_kv": statistics.mean(a.kv_bytes_full for a in answers),
            "transfer_gbps": moved / transfer / 1e9 if transfer > 0 else float("nan"),
            "answers": [a.text for a in answers],
        })
    base = next(r for r in rows if r["method"] == "full")
    for r in rows:
        r["ratio"] = r["bytes_moved"] / base["bytes_moved"]
        r["speedup"] = r["qps"] / base["qps"]
    return rows


def _median_time(fn, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def link_bandwidth(store: MiloStore, device: torch.device, nbytes: int, repeat: int = 5) -> dict[str, float]:
    """GB/s of the transfer path for ``nbytes`` (one query's full-KV bytes), measured now.

    CPU: a host memcpy, and a preadv of the store's chunk files from the page cache (the disk tier's
    read). CUDA: host-to-device copies from pinned and from pageable memory.
    """
    n = max(1, min(nbytes, int(store.offsets[-1]) * store.itemsize) // store.itemsize)
    src = torch.randn(n).to(store.torch_dtype)
    out = {}
    if device.type == "cuda":
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
        dst = torch.empty_like(src, device=device)
        pinned = src.pin_memory()
        out["H2D pinned"] = _median_time(lambda: dst.copy_(pinned, non_blocking=True), repeat, sync)
        out["H2D pageable"] = _median_time(lambda: dst.copy_(src), repeat, sync)
    else:
        dst = torch.empty_like(src)
        out["memcpy"] = _median_time(lambda: dst.copy_(src), repeat, lambda: None)
        store._read_range(0, n, dst)  # warm the page cache
        out["preadv (page cache)"] = _median_time(lambda: store._read_range(0, n, dst), repeat, lambda: None)
    return {name: n * store.itemsize / s / 1e9 for name, s in out.items()}


def kernel_speedup(session: TimedSession, block_ids: list[int], repeat: int = 3) -> dict[str, float]:
    """Seconds to rebuild every layer of one retrieval through `reconstruct_layer` (validation included):
    MILO_KERNEL=reference (the literal oracle) vs the device's own path (batched CPU, or Triton)."""
    store, layout, dev = session.store, session.layout, session.device
    prefetch = LayerPrefetcher(store, block_ids, dev)
    tokens = store.block_tokens[block_ids]
    dst = np.concatenate(([0], np.cumsum(tokens)[:-1])).astype(np.int64)
    layers = []
    for l in range(layout.num_layers):
        factors, starts = prefetch.layer(l)
        layers.append((factors.clone(), torch.from_numpy(layout.layer_segments(store.ranks[block_ids, l], tokens,
                                                                              dst, starts))))
    engine = session.engine
    out_k = torch.empty(layout.num_kv_heads, int(tokens.sum()), layout.head_dim, dtype=engine.dtype, device=dev)
    out_v = torch.empty_like(out_k)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def run(fn):
        for factors, segments in layers:
            fn(factors, segments, out_k, out_v, engine.cos, engine.sin, interleaved=session.mounted.rope_interleaved,
               quant=layout.quant)

    times = {}
    for name, backend in (("reference", "reference"), ("kernel", "")):  # "" = the device's own kernel
        with _env("MILO_KERNEL", backend):
            run(reconstruct_layer)  # warm up (Triton compiles on first use)
            times[name] = _median_time(lambda: run(reconstruct_layer), repeat, sync)
    return times


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def run_bench(loaded: LoadedModel, store_paths: dict[str, Path], queries: list[str], *, ks=(2, 4, 8), batches=(1, 4),
              rounds: int = 3, ratios=(0.5, 0.25), tier: str = "host", device=None, progress=print) -> dict:
    """Every (k, batch) × method, the transfer path's raw bandwidth and the kernel's speedup; one report."""
    stores = {name: MiloStore.open(path, tier=tier) for name, path in store_paths.items()}
    try:
        sessions = {m: TimedSession(loaded, stores[store_of(m)], device=device, copy_identity=m == "full")
                    for m in method_names(ratios)}
        first = next(iter(sessions.values()))
        dev = first.device
        ks = sorted({min(k, first.store.num_blocks) for k in ks})
        for s in sessions.values():  # warm up: first-touch allocations, lazy imports, kernel compilation
            s.k = max(ks)
            s.answer(queries[0])
        rows = []
        for k in ks:
            for b in batches:
                rows += measure(sessions, queries, k, b, rounds)
                progress(f"bench: k={k} batch={b} done")
        top = [r for r in rows if r["k"] == max(ks) and r["batch"] == batches[0]]
        full_bytes = next(r["bytes_full_kv"] for r in top if r["method"] == "full")
        link = link_bandwidth(stores["full"], dev, int(full_bytes))
        first.k = max(ks)
        blocks = first.select(queries[0])
        kernels = {m: kernel_speedup(sessions[m], blocks) for m in sessions if m.startswith("milo")}
        shape = first.layout
        return {"rows": rows, "link_gbps": link, "kernel_s": kernels, "device": str(dev),
                "model": loaded.identity["name"], "layout": dataclasses.asdict(shape),
                "store_blocks": first.store.num_blocks, "block_tokens": first.store.block_tokens.tolist(),
                "tier": tier, "rounds": rounds, "threads": torch.get_num_threads(), "ratios": list(ratios),
                "crossover": crossover(top)}
    finally:
        for s in stores.values():
            s.close()


def crossover(rows: list[dict]) -> dict[str, dict]:
    """Per MILO method, the link bandwidth at which its saved bytes pay for its extra rebuild time.

    Moving B bytes over a link of bandwidth W costs B/W; MILO saves (B_full − B_milo)/W of transfer and
    spends (rebuild_milo − rebuild_full) more on reconstruction, so it wins on links slower than
    W* = (B_full − B_milo) / (rebuild_milo − rebuild_full). Rebuild times are the measured ones of the
    full copy and of MILO's kernel on this device, per query.
    """
    full = next(r for r in rows if r["method"] == "full")
    out = {}
    for r in rows:
        if not r["method"].startswith("milo"):
            continue
        saved = full["bytes_moved"] - r["bytes_moved"]
        extra = (r["ms"]["rebuild"] - full["ms"]["rebuild"]) / 1e3
        out[r["method"]] = {"bytes_saved": saved, "extra_rebuild_s": extra,
                            "crossover_gbps": saved / extra / 1e9 if extra > 0 else float("inf")}
    return out


# --- reporting -----------------------------------------------------------------------------------

def render_markdown(report: dict) -> str:
    lay = report["layout"]
    lines = [f"model {report['model']} ({lay['num_layers']} layers, {lay['num_kv_heads']} KV heads, d={lay['head_dim']}) "
             f"on {report['device']}, {report['threads']} threads; store {report['store_blocks']} blocks of "
             f"{min(report['block_tokens'])}-{max(report['block_tokens'])} tokens, {report['tier']} tier; "
             f"medians of {report['rounds']} interleaved rounds",
             "",
             "| method | ρ (bytes) | k | batch | q/s | tok/s | retrieve ms | read ms | transfer ms | rebuild ms "
             "| model ms | MiB/query | transfer GB/s | speedup vs full | bound 1/ρ |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        ms = r["ms"]
        lines.append(f"| {r['method']} | {r['ratio']:.3f} | {r['k']} | {r['batch']} | {r['qps']:.2f} | {r['tok_s']:.1f} | "
                     + " | ".join(f"{ms[s]:.1f}" for s in STAGES)
                     + f" | {r['bytes_moved'] / 2**20:.2f} | {r['transfer_gbps']:.2f} | {r['speedup']:.2f} | "
                     f"{1 / r['ratio']:.2f} |")
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
    rows = [r for r in report["rows"] if r["method"] != "full-gemm"]
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


# --- a workload without a real model -------------------------------------------------------------

SHAPES = {
    # Qwen2.5-7B's decoder (vocab and positions included); random weights.
    "qwen2.5-7b": dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=300, max_position_embeddings=4096),
}
SYNTHETIC_LABELS = tuple(f"c{i:02d}" for i in range(16))  # " c07" + newline: 5 generated tokens each


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges, built in memory: needs no files and no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def random_model(shape: str, device="cpu", dtype=torch.float32) -> LoadedModel:
    """A Qwen2 model of a named shape with random weights, initialised directly on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), identity=model_identity(model))


def synthetic_stores(root, loaded: LoadedModel, *, demos: int, block_size: int, demo_tokens: int, ratios,
                     seed: int = 0) -> dict[str, Path]:
    """Every method's store over the same synthetic K/V, with the attrs a session checks (model, task).

    Each block holds ``block_size`` fake demonstrations of ``demo_tokens`` tokens about one topic word,
    so BM25 retrieval of a query naming topics picks distinct blocks. SVD runs on the GPU when there is one.
    """
    root = Path(root)
    ident = loaded.identity
    layout = Layout(ident["num_layers"], ident["num_kv_heads"], ident["head_dim"])
    n_blocks = -(-demos // block_size)
    task = TaskSpec(name="synthetic", template="Input: {input}\nLabel: {output}\n", anchor="Label each input.",
                    answer_kind="label", labels=SYNTHETIC_LABELS)
    anchor_ids = loaded.tokenizer(task.anchor, add_special_tokens=True).input_ids
    g = torch.Generator().manual_seed(seed)
    svd_device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = [demo_tokens * min(block_size, demos - b * block_size) for b in range(n_blocks)]
    stagings = {c: Staging(root / f"staging-{c}", {"synthetic": seed, "codec": c, "layout": str(layout),
                                                   "tokens": tokens}) for c in ("identity", "svd")}
    for b, t in enumerate(tokens):
        if all(s.has(b) for s in stagings.values()):
            continue
        k, v = synthetic_block_kv(layout, t, g)
        stagings["identity"].put(b, factorize_block(k, v, codec="identity"))
        f = factorize_block(k.to(svd_device), v.to(svd_device), codec="svd")
        stagings["svd"].put(b, dataclasses.replace(f, A=f.A.cpu(), S=f.S.cpu(), B=f.B.cpu()))
    examples = {"input": [f"demonstration {i} about topic{i // block_size}" for i in range(demos)],
                "output": [SYNTHETIC_LABELS[i % len(SYNTHETIC_LABELS)] for i in range(demos)],
                "id": [str(i) for i in range(demos)], "block": [i // block_size for i in range(demos)]}
    anchor = torch.randn(layout.num_layers, 2, layout.num_kv_heads, len(anchor_ids), layout.head_dim, generator=g)
    attrs = {"model": ident, "task": dataclasses.asdict(task),
             "build": {"block_size": block_size, "synthetic": True, "anchor_token_ids": anchor_ids}}
    paths = {}
    for name, config in store_configs(ratios).items():
        paths[name] = write_store(root / name, stagings[config.codec], n_blocks, layout, config, attrs=attrs,
                                  anchor_kv=anchor, examples=examples, force=True)
    return paths


def synthetic_queries(n: int, n_blocks: int, k: int) -> list[str]:
    """Queries naming k topics each, rotating through the blocks."""
    return [" ".join(f"topic{(q * k + j) % n_blocks}" for j in range(k)) + f" question {q}" for q in range(n)]
