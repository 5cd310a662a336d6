"""What a store holds, as plain data: a summary (`describe`), per-block rows (`block_rows`), the
demonstrations of some blocks (`block_demonstrations`), sizes for people.

Library code the `milo-store stat`/`ls` commands print, and that `milo_infer.evaluation.demo` and
tools/bench_scale.py call directly.
"""
import numpy as np

from .layout import RAW_RANK
from .store import MiloStore


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def describe(store: MiloStore) -> dict:
    acc = store.accounting()
    r = store.ranks.astype(np.int64)
    raw = r == RAW_RANK
    present = np.broadcast_to(store.layout.present, r.shape)
    kinds = tuple(enumerate(("key", "value")))
    hist = {kind: [np.bincount(r[:, l, k][~raw[:, l, k] & present[:, l, k]], minlength=store.layout.head_dim + 1).tolist()
                   for l in range(store.layout.num_layers)] for k, kind in kinds}
    factored = np.ma.masked_array(r, raw | ~present)  # mean ranks are over stored factored units; raw ones apart
    raw_share = np.ma.masked_array(raw, ~present)
    return {
        "path": str(store.path), "format_version": store.meta["format_version"],
        "model": store.meta.get("model"), "codec": store.meta.get("codec"), "allocation": store.meta.get("allocation"),
        "factor_dtype": store.dtype, "layout": store.meta["layout"],
        "blocks": store.num_blocks, "demonstrations": store.num_examples(), "tokens": int(store.block_tokens.sum()),
        "planned_ratio": acc["planned_ratio"], "actual_ratio": acc["ratio"],
        "bytes": {"full_fp16_kv": acc["full_fp16_bytes"], "factors": acc["factor_bytes"],
                  "states": acc.get("state_bytes", 0), "index": acc["index_bytes"],
                  "accounted": acc["total_bytes"], "factor_files": acc["factor_file_bytes"], "on_disk": acc["disk_bytes"],
                  "dead": acc["dead_bytes"]},
        "chunks": {"factor": (len(np.unique(store.placement.extents[:, 0])) if store.segmented
                              else len(store.placement.names)), "text": len(store.segment_table)},
        "disk_ratio": acc["disk_bytes"] / acc["full_fp16_bytes"] if acc["full_fp16_bytes"] else None,
        "mean_rank_per_layer": {kind: [None if x is np.ma.masked else round(float(x), 2)
                                       for x in factored[:, :, k].mean(axis=(0, 2))] for k, kind in kinds},
        "rank_histogram_per_layer": hist,
        "raw_share_per_layer": {kind: [None if x is np.ma.masked else round(float(x), 4)
                                       for x in raw_share[:, :, k].mean(axis=(0, 2))] for k, kind in kinds},
        "layer_groups": layer_groups(store, acc),
        **store.codec.summary(),  # what the codec adds (a bits store: its mean code width per layer)
    }


def layer_groups(store: MiloStore, acc: dict) -> list[dict]:
    """The store's layers by what they hold (`Layout.layer_groups`: 'kv HxD', 'v HxD' for K = V, 'latent R+C',
    'linear HxKxV', 'shared'), each group's stored bytes (factors; a linear layer's state sections) and its fp16 K/V
    (what a store holding every layer in full would keep: an MLA layer's one unit, a linear layer's none)."""
    layout, tokens = store.layout, store.block_tokens
    groups = layout.layer_groups()
    per_layer = None
    if len(groups) > 1:  # block bytes by layer: the low-rank codec's segments (one group: every factor byte)
        per_layer = (layout.segment_sizes(store.ranks, tokens).sum(axis=(0, 2, 3))
                     + len(tokens) * layout.state_sizes) * store.itemsize
    out = []
    for name, layers in groups.items():
        spec = layout.layers[layers[0]]
        units = 0 if spec.state_values else 1 if spec.latent else 2  # K and V; MLA's one unit; a state's none
        full = units * int(tokens.sum()) * spec.kv_heads * spec.head_dim * 2 * len(layers)  # fp16
        stored = acc["factor_bytes"] if per_layer is None else int(per_layer[layers].sum())
        out.append({"group": name, "layers": layers, "factor_bytes": stored, "full_fp16_bytes": full})
    return out


def demonstrations_per_block(store: MiloStore, start: int, stop: int) -> np.ndarray:
    """From the block starts (a format-4 store's segments, a format-3 store's BM25 index: a few entries per
    block); stores without them count every demonstration's block."""
    return np.diff(store.block_starts()[start:stop + 1])


def rank_summary(ranks: np.ndarray, present: np.ndarray | None = None) -> dict:
    """min/mean/max rank of a block's factored units of one kind, and how many are raw (RAW_RANK); ``present``: the
    units its layout stores (a shared or linear layer's, heads past a layer's own: none)."""
    r = ranks.astype(int)[present] if present is not None else ranks.astype(int).ravel()
    factored = r[r != RAW_RANK]
    if not len(factored):
        return {"min": None, "mean": None, "max": None, "raw": len(r)}
    return {"min": int(factored.min()), "mean": round(float(factored.mean()), 2), "max": int(factored.max()),
            "raw": int(len(r) - len(factored))}


def block_rows(store: MiloStore, offset: int = 0, limit: int = 0) -> list[dict]:
    start = min(offset, store.num_blocks)
    stop = store.num_blocks if limit == 0 else min(start + limit, store.num_blocks)
    per_block = demonstrations_per_block(store, start, stop)
    nbytes = store.block_bytes(range(start, stop))
    rows = []
    for i in range(start, stop):
        rows.append({"block": i, "tokens": int(store.block_tokens[i]), "demonstrations": int(per_block[i - start]),
                     "key_rank": rank_summary(store.ranks[i, :, 0], store.layout.present[:, 0]),
                     "value_rank": rank_summary(store.ranks[i, :, 1], store.layout.present[:, 1]),
                     "bytes": int(nbytes[i - start])})
    return rows


def block_demonstrations(store: MiloStore, blocks) -> dict[int, list[tuple[str, str]]]:
    """(input, output) of each of ``blocks``' demonstrations, in store order.

    Reads the demonstrations' block numbers, inputs and outputs (not their ids) through the store's
    checked reads: each array's checksum covers the whole array, so a damaged demonstration is refused
    rather than shown, at the price of reading all of their text once when any block is shown.
    """
    wanted = sorted({int(b) for b in blocks})
    found = {b: [] for b in wanted}
    if not store.num_examples() or not wanted:
        return found
    block_of = store.example_array("block")
    rows = np.flatnonzero(np.isin(block_of, wanted))
    inputs, outputs = (store.example_array(name)[rows].tolist() for name in ("input", "output"))
    for block, text, answer in zip(block_of[rows].tolist(), inputs, outputs):
        found[block].append((text, answer))
    return found
