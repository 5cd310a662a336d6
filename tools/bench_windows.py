"""What a window layer reads and holds through the engine (issue 46, item 3), against reading and holding every
layer, side by side in one run, with the answers compared.

    python tools/bench_windows.py                        # Gemma 3's shape: 18 layers, 1 KV head of 256, W 512
    python tools/bench_windows.py --k 6 --block-tokens 530 --ratio 0.5 --queries 4

A random Gemma 3 text model of the shape (its hidden size and vocabulary small: they do not change K/V bytes)
and a synthetic store of k blocks of ``--block-tokens`` tokens written at ``--ratio`` as `milo build` writes
(`milo_infer.bench.synthetic_model.synthetic_stores`). Each query places every block after the anchor and is
answered alone by two engines over the same store: ``Engine(window_reach=True)`` (a window layer reads,
rebuilds and holds pages for only what its window reaches) and ``window_reach=False`` (every layer of every
block). Counted, not computed: the factor bytes the prefetcher staged for the rebuild (``fetch_stats``'
``staged_bytes``, on a CPU what a GPU's link would carry) and the K/V bytes the batch's pools allocated for the
row (``kv_bytes_allocated``: numel × element size of every pool), per query; the query logits of both engines
(largest |difference|) and their answers.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from milo_infer.bench.synthetic_model import byte_tokenizer, synthetic_queries, synthetic_stores  # noqa: E402
from milo_infer.models import LoadedModel, model_identity  # noqa: E402
from milo_infer.runtime.engine import Engine  # noqa: E402
from milo_infer.runtime.planning import Request  # noqa: E402
from milo_store import MiloStore  # noqa: E402


def gemma3_model(layers: int, kv_heads: int, head_dim: int, window: int, full_every: int) -> LoadedModel:
    """A random Gemma 3 text model: every ``full_every``-th layer full, the others windows of ``window``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(num_hidden_layers=layers, num_attention_heads=4 * kv_heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, hidden_size=128, intermediate_size=256, vocab_size=300,
                              max_position_embeddings=32768, sliding_window=window, query_pre_attn_scalar=head_dim,
                              layer_types=["full_attention" if (layer + 1) % full_every == 0 else "sliding_attention"
                                           for layer in range(layers)], pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), identity=model_identity(model))


@torch.inference_mode()
def measure(loaded: LoadedModel, store: MiloStore, queries: list[str]) -> dict:
    """Per engine ("window", "every"): mean bytes staged and K/V allocated per query, seconds per query; the answers
    and the largest logit difference between them."""
    engines = {"window": Engine(loaded, {"s": store}, window_reach=True),
               "every": Engine(loaded, {"s": store}, window_reach=False)}
    blocks = list(range(store.num_blocks))
    out = {name: {"staged": [], "held": [], "seconds": [], "answers": []} for name in engines}
    logits_apart, prefix = 0.0, 0
    for q in queries:
        logits = {}
        for name, engine in engines.items():  # interleaved, so the machine's load falls on both alike
            plan = engine.plan("s", Request(text=q), block_ids=blocks)
            prefix = plan.prefix_tokens
            stats: dict = {}
            t = time.perf_counter()
            answer = engine.answer([plan], stats)[0]
            out[name]["seconds"].append(time.perf_counter() - t)
            out[name]["staged"].append(stats["staged_bytes"])
            out[name]["held"].append(stats["kv_bytes_allocated"])
            out[name]["answers"].append(answer.text)
            logits[name] = engine.logits([plan])[0]
        logits_apart = max(logits_apart, float((logits["window"] - logits["every"]).abs().max()))
    summary = {name: {"staged": statistics.mean(m["staged"]), "held": statistics.mean(m["held"]),
                      "seconds": statistics.median(m["seconds"]), "answers": m["answers"]} for name, m in out.items()}
    return {**summary, "logits_apart": logits_apart, "prefix_tokens": prefix,
            "same_answers": sum(a == b for a, b in zip(out["window"]["answers"], out["every"]["answers"]))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--full-every", type=int, default=6, help="every n-th layer attends in full (Gemma 3: 6)")
    parser.add_argument("--k", type=int, default=6, help="blocks in the store, every one placed in each query")
    parser.add_argument("--block-tokens", type=int, default=530, help="a block's tokens (10 demonstrations of a tenth)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.block_tokens % 10:
        parser.error("--block-tokens must be a multiple of 10 (10 demonstrations a block)")
    loaded = gemma3_model(args.layers, args.kv_heads, args.head_dim, args.window, args.full_every)
    with tempfile.TemporaryDirectory(prefix="milo-windows-") as tmp:
        paths = synthetic_stores(tmp, loaded, demos=10 * args.k, block_size=10, demo_tokens=args.block_tokens // 10,
                                 ratios=[args.ratio])
        with MiloStore.open(paths[f"milo-r{args.ratio:g}"]) as store:
            m = measure(loaded, store, synthetic_queries(args.queries, args.k, args.k))
    config = loaded.model.config
    windowed = sum(kind == "sliding_attention" for kind in config.layer_types)
    print(f"{args.layers} layers ({args.layers - windowed} full, {windowed} windows of {args.window}), {args.kv_heads} "
          f"KV head(s) of {args.head_dim}; k {args.k} blocks of {args.block_tokens} tokens (prefix "
          f"{m['prefix_tokens']}), ratio {args.ratio}, {args.queries} queries, each answered alone by both engines")
    print(f"{'per query':<26} {'window reach':>14} {'every layer':>14} {'ratio':>7}")
    for label, key in (("factor bytes staged", "staged"), ("K/V bytes held (pools)", "held")):
        w, e = m["window"][key], m["every"][key]
        print(f"{label:<26} {w:>14,.0f} {e:>14,.0f} {w / e:>7.1%}")
    w, e = m["window"]["seconds"], m["every"]["seconds"]
    print(f"{'seconds (median)':<26} {w:>14.3f} {e:>14.3f} {w / e:>7.2f}")
    print(f"answers equal: {m['same_answers']} of {args.queries}; largest |logit difference| {m['logits_apart']:.2e}")


if __name__ == "__main__":
    main()
