"""What a block of a hybrid model's Gated DeltaNet layer would cost stored two ways, side by side (issue 61's choice):

* inputs: each token's k (per key head), v, β and g, which a row runs from its state with `delta_rule.advance`
  (matmuls and one triangular solve per 64 tokens);
* pair: the block's dense (M, C) per value head in fp32, which a row applies with one matmul each
  (`delta_rule.apply`), whatever the block's length.

Either also keeps the block's conv tail (the last kernel−1 convolution inputs). At Qwen3.5-0.8B's linear layers
(released config: 16 key and 16 value heads of 128, kernel 4; 18 of its 24 layers; random inputs as a layer makes
them): bytes a block and layer, the state error either adds after the row's blocks when kept in fp16 or bf16, and
the time a row's state takes through `--blocks` blocks per layer and for all 18, interleaved rounds, medians, one
torch thread unless told. ``--prefill`` also times prefilling the same tokens through a random Qwen3.5-0.8B-shaped
text model (vocab cut to 4,096: the first token's logits are one row of it), the cost the state replaces. ``--store
DIR`` instead times a row's composition through the engine's own read path on a store of that shape. Run:

    PYTHONPATH=$PWD .venv/bin/python tools/bench_linear_state.py --tokens 20,80,320 --blocks 6 --prefill --threads 1
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.bench.synthetic_model import SHAPES  # noqa: E402
from milo_infer.models import delta_rule  # noqa: E402

QWEN3_5_0_8B = SHAPES["qwen3.5-0.8b"]  # Qwen3.5-0.8B's text config, vocabulary cut to 4,096
LAYERS, FULL_EVERY = QWEN3_5_0_8B["num_hidden_layers"], QWEN3_5_0_8B["full_attention_interval"]
LINEAR_LAYERS = LAYERS - LAYERS // FULL_EVERY  # every layer but each full_attention_interval-th


def random_block(tokens: int, heads: int, key_dim: int, value_dim: int, gen):
    k = torch.randn(tokens, heads, key_dim, generator=gen)
    return (k / k.norm(dim=-1, keepdim=True), torch.randn(tokens, heads, value_dim, generator=gen),
            torch.rand(tokens, heads, generator=gen), -0.05 * torch.rand(tokens, heads, generator=gen))


def block_bytes(tokens: int, shape: dict, input_bytes: int) -> dict:
    heads_k, heads_v = shape["linear_num_key_heads"], shape["linear_num_value_heads"]
    dk, dv = shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    tail = (shape["linear_conv_kernel_dim"] - 1) * (2 * heads_k * dk + heads_v * dv) * input_bytes
    return {"inputs": tokens * (heads_k * dk + heads_v * dv + 2 * heads_v) * input_bytes + tail,
            "pair": heads_v * dk * (dk + dv) * 4 + tail}


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def apply_all(pairs, state):
    for pair in pairs:
        state = delta_rule.apply(pair, state)
    return state


def rounded_errors(blocks, pairs, start, dtype) -> tuple[float, float]:
    """Relative errors of the state the row reaches when its blocks' inputs, or their pairs, were kept in `dtype`."""
    exact = delta_rule.advance(start, *[torch.cat(p) for p in zip(*blocks)])
    rounded = [[x.to(dtype).float() for x in b] for b in blocks]
    by_inputs = delta_rule.advance(start, *[torch.cat(p) for p in zip(*rounded)])
    by_pairs = apply_all([[x.to(dtype).float() for x in pair] for pair in pairs], start)
    return tuple(((state - exact).norm() / exact.norm()).item() for state in (by_inputs, by_pairs))


def prefill_seconds(tokens: int, rounds: int) -> float:
    from transformers import Qwen3_5TextConfig

    from milo_infer.models.multimodal import causal_lm_class

    config = Qwen3_5TextConfig(**QWEN3_5_0_8B)
    model = causal_lm_class(config).from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with torch.no_grad():
        return statistics.median(seconds(lambda: model(ids, logits_to_keep=1)) for _ in range(rounds))


def store_composition(path: str, blocks: int, rounds: int) -> None:
    """One row's composition as the engine does it (`PrefixRebuild.linear_states` at every linear layer, the store's
    sections staged as an admission stages them) over a Qwen3.5-0.8B-shaped store's first ``blocks`` blocks."""
    from transformers import Qwen3_5TextConfig

    from milo_infer.models import config_layer_rope_tables
    from milo_infer.runtime.prefix import PrefixRebuild, StorePrefix
    from milo_store import MiloStore

    rope = config_layer_rope_tables(Qwen3_5TextConfig(**QWEN3_5_0_8B), 32768)
    with MiloStore.open(path) as store:
        prefix = StorePrefix("s", store, rope, "cpu", torch.float32)
        linear = [l for l, spec in enumerate(store.layout.layers) if spec.state_values]

        def compose():
            rebuild = PrefixRebuild([prefix.place(list(range(blocks)))], rope, "cpu")
            for layer in range(len(store.layout.layers)):  # in order, as the forward reaches them
                rebuild.linear_states(layer) if layer in linear else rebuild.fetched[prefix].layer(layer)

        taken = statistics.median(seconds(compose) for _ in range(rounds))
    print(f"{path}: a row composing {blocks} blocks at {len(linear)} linear layers: {taken * 1e3:.1f} ms "
          f"({taken * 1e3 / len(linear):.2f} ms a layer; staging the row's blocks included)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="20,80,320", help="tokens a block (comma-separated)")
    p.add_argument("--blocks", type=int, default=6, help="blocks a row places (default 6)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--prefill", action="store_true", help="also time prefilling the row's tokens (slow)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--store", metavar="DIR", help="time a row's composition from this Qwen3.5-0.8B-shaped store "
                   "instead (`milo bench --synthetic qwen3.5-0.8b` builds one)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.store:
        store_composition(args.store, args.blocks, args.rounds)
        return 0
    shape = QWEN3_5_0_8B
    heads, dk, dv = shape["linear_num_value_heads"], shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    print(f"Qwen3.5-0.8B linear layer: {heads} value heads, k {dk}, v {dv}; a row places {args.blocks} blocks; "
          f"{args.threads} thread(s); medians of {args.rounds}")
    print("tokens | KiB a block and layer: inputs fp16 / pair fp32 | state error kept in fp16 / bf16: inputs, pair | "
          "ms a row and layer: inputs / pair | s a row, 18 layers: inputs / pair | s to build a pair"
          + (" | s prefilling the row" if args.prefill else ""))
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(tokens)
        blocks = [random_block(tokens, heads, dk, dv, gen) for _ in range(args.blocks)]
        start = torch.randn(heads, dk, dv, generator=gen) * 0.1
        build = [seconds(delta_rule.transition, *blocks[0])]
        pairs = [delta_rule.transition(*b) for b in blocks]
        joined = [torch.cat(part) for part in zip(*blocks)]
        torch.testing.assert_close(apply_all(pairs, start), delta_rule.advance(start, *joined), rtol=0, atol=1e-3)
        by_inputs, by_pairs = [], []
        for _ in range(args.rounds):
            by_inputs.append(seconds(delta_rule.advance, start, *joined))
            by_pairs.append(seconds(apply_all, pairs, start))
            build.append(seconds(delta_rule.transition, *blocks[0]))
        sizes = block_bytes(tokens, shape, 2)
        (inputs16, pair16), (inputs_bf, pair_bf) = (rounded_errors(blocks, pairs, start, dtype)
                                                    for dtype in (torch.float16, torch.bfloat16))
        t_in, t_pair = statistics.median(by_inputs), statistics.median(by_pairs)
        row = (f"{tokens:6d} | {sizes['inputs'] / 1024:10.0f} / {sizes['pair'] / 1024:6.0f} | "
               f"{inputs16:.1e} / {inputs_bf:.1e}, {pair16:.1e} / {pair_bf:.1e} | "
               f"{t_in * 1e3:7.1f} / {t_pair * 1e3:6.1f} | {t_in * LINEAR_LAYERS:6.2f} / {t_pair * LINEAR_LAYERS:5.2f} | "
               f"{statistics.median(build):.3f}")
        if args.prefill:
            row += f" | {prefill_seconds(tokens * args.blocks, args.rounds):.2f}"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
