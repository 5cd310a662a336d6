"""What a window layer would read and hold if it read and held only the blocks its window reaches (issue 46,
item 3), against reading and holding every layer's, on a synthetic store of a model's shape (real stored bytes).

    python tools/bench_windows.py                        # Gemma 3's shape: 18 layers, 1 KV head of 256, W 512
    python tools/bench_windows.py --k 6 --block-tokens 530 --ratio 0.5

Per query, k blocks placed after the anchor, the query's first token after them: bytes read are the placed
blocks' stored factor bytes of each layer (`MiloStore.block_layer_bounds`), a window layer's only for the blocks
`BlockPlacement.reached_by_windows` names; K/V held are fp16 pages of 128 columns per layer, a window layer's
only from the page holding its window's first column (as vLLM's sliding-window manager frees pages). The engine
does not act on it yet: this is the goal's arithmetic over real bytes, printed as ratios.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from milo_infer.runtime.pages import PAGE_TOKENS, pages_for  # noqa: E402
from milo_infer.runtime.prefix import BlockPlacement  # noqa: E402
from milo_store import CompressionConfig, Layout, MiloStore  # noqa: E402
from milo_store.synthetic import build_synthetic_store  # noqa: E402


def measure(store: MiloStore, blocks: list[int], windows: list[int | None], query_tokens: int) -> dict:
    layout = store.layout
    anchor = store.anchor_kv().shape[3]
    tokens = [int(store.block_tokens[b]) for b in blocks]
    starts = anchor + np.concatenate([[0], np.cumsum(tokens)[:-1]]).astype(np.int64)
    placement = BlockPlacement("s", blocks, starts, np.zeros(0), anchor + sum(tokens), 0, 0)
    first = placement.prefix_tokens  # the query's first token
    reached = placement.reached_by_windows(first, windows)
    read_all = read_window = 0
    for i, block in enumerate(blocks):
        bounds = store.block_layer_bounds(block)
        for layer in range(layout.num_layers):
            size = int(bounds[layer + 1] - bounds[layer]) * store.itemsize
            read_all += size
            read_window += size if i in reached[layer] else 0
    columns = first + query_tokens
    page_bytes = 2 * layout.num_kv_heads * layout.head_dim * 2 * PAGE_TOKENS  # K and V, fp16, one layer
    held_all = layout.num_layers * pages_for(columns) * page_bytes
    held_window = sum((pages_for(columns) if w is None else pages_for(columns) - max(0, first - w + 1) // PAGE_TOKENS)
                      * page_bytes for w in windows)
    return {"prefix_tokens": first, "read_all": read_all, "read_window": read_window, "held_all": held_all,
            "held_window": held_window, "blocks_per_window_layer": [len(r) for r, w in zip(reached, windows) if w]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--full-every", type=int, default=6, help="every n-th layer attends in full (Gemma 3: 6)")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--block-tokens", type=int, default=530)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--query-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    windows = [None if (layer + 1) % args.full_every == 0 else args.window for layer in range(args.layers)]
    with tempfile.TemporaryDirectory(prefix="milo-windows-") as tmp:
        build_synthetic_store(Path(tmp) / "s", Layout(args.layers, args.kv_heads, args.head_dim),
                              [args.block_tokens] * args.k, CompressionConfig(ratio=args.ratio))
        with MiloStore.open(Path(tmp) / "s") as store:
            m = measure(store, list(range(args.k)), windows, args.query_tokens)
    print(f"{args.layers} layers ({windows.count(None)} full, the rest windows of {args.window}), {args.kv_heads} KV "
          f"head(s) of {args.head_dim}; k {args.k} blocks of {args.block_tokens} tokens (prefix {m['prefix_tokens']}), "
          f"ratio {args.ratio}, query {args.query_tokens} tokens")
    print(f"blocks each window layer reaches: {sorted(set(m['blocks_per_window_layer']))} of {args.k}")
    print(f"bytes read per query: {m['read_window']:,} of {m['read_all']:,} = {m['read_window'] / m['read_all']:.1%}")
    print(f"K/V held per row:     {m['held_window']:,} of {m['held_all']:,} = {m['held_window'] / m['held_all']:.1%}")


if __name__ == "__main__":
    main()
