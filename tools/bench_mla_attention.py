"""MLA's two ways to attend a stored latent, side by side: absorbed (the engine's) against expanded (transformers').

One MLA layer of DeepSeek-V2-Lite's shape (random weights: 16 heads of 128 + 64, values of 128, latent 512), its
columns a row's cached units [rope key | latent]:

* absorbed (the engine's own `milo_infer.runtime.attention.latent_attention`, over one row's pages): each head's query
  through W_uk into one over the unit, every head attending the one shared unit (a grouped-query attention of one KV
  head, the latent its value), the softmax-weighted latents through W_uv;
* expanded (transformers' `expand_kv`): every column's latent through ``kv_b_proj`` into 16 heads of K and V, then
  SDPA.

Both give the same output (checked to 1e-4 here before timing). Timed for a decode step (one query token) and a
prefill chunk, over several context lengths, rounds interleaved, medians; one torch thread unless told. Run:

    PYTHONPATH=$PWD .venv/bin/python tools/bench_mla_attention.py --columns 1024,4096,16384 --chunk 128 --threads 1
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
from milo_infer.runtime.attention import LayerAttention, latent_attention  # noqa: E402
from milo_infer.runtime.cache import Pack, Segment  # noqa: E402
from milo_infer.runtime.pages import PAGE_TOKENS, pages_for  # noqa: E402


def mla_layer():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention

    torch.manual_seed(0)
    config = DeepseekV2Config(**SHAPES["deepseek-v2-lite"])
    return DeepseekV2Attention(config, 0).eval().requires_grad_(False), config


def one_row(columns: int, n: int, mask) -> Pack:
    """A pack of one row on consecutive pages whose last ``n`` columns are its new tokens."""
    pages = list(range(pages_for(columns)))
    segment = Segment(pages=pages, device_pages=torch.tensor(pages), run=0, start=0, stop=n, keys=columns,
                      positions=torch.arange(columns - n, columns), mask=mask)
    return Pack(segments=[segment], columns=torch.arange(columns - n, columns))


def paged(units: torch.Tensor) -> torch.Tensor:
    """One row's units [1, columns, width] in a pool of whole pages, as the engine's cache holds them."""
    pool = units.new_zeros(1, pages_for(units.shape[1]) * PAGE_TOKENS, units.shape[2])
    pool[:, :units.shape[1]] = units
    return pool


def absorbed(module, query, pool, pack):
    """The engine's own attention of an MLA layer over one row's units (`latent_attention`), [1, H, n, v]."""
    return latent_attention(module, query, pool, pack, LayerAttention(scaling=module.scaling)).transpose(1, 2)


def expanded(module, query, units, mask):
    rope = module.qk_rope_head_dim
    k, v = module.expand_kv(units[None, :, :, rope:], units[None, :, :, :rope])
    return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=module.scaling)


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--columns", default="1024,4096,16384", help="context lengths (cached units a row attends)")
    p.add_argument("--chunk", type=int, default=128, help="query tokens of a prefill chunk (default 128)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved repetitions (default 5)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    module, config = mla_layer()
    H, width = config.num_attention_heads, config.qk_rope_head_dim + config.kv_lora_rank
    print(f"one MLA layer of DeepSeek-V2-Lite's shape ({H} heads, latent {config.kv_lora_rank}, rope "
          f"{config.qk_rope_head_dim}), fp32, {args.threads} thread(s); medians of {args.rounds} interleaved rounds\n")
    print("| columns | query tokens | absorbed ms | expanded ms | expanded / absorbed |")
    print("|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for columns in (int(c) for c in args.columns.split(",")):
            units = torch.randn(1, columns, width)
            for n in (1, args.chunk):
                query = torch.randn(1, H, n, config.qk_nope_head_dim + config.qk_rope_head_dim)
                mask = None if n == 1 else torch.arange(columns)[None, :] <= torch.arange(columns - n, columns)[:, None]
                pool, pack = paged(units), one_row(columns, n, mask)  # made once: the engine's cache holds them
                a, b = absorbed(module, query, pool, pack), expanded(module, query, units, mask)
                if not torch.allclose(a, b, atol=1e-4 * float(b.abs().max()), rtol=0):
                    raise SystemExit(f"the two ways differ at {columns} columns, {n} tokens: {(a - b).abs().max():.3g}")
                times = {"absorbed": [], "expanded": []}
                for _ in range(args.rounds):
                    times["absorbed"].append(seconds(absorbed, module, query, pool, pack))
                    times["expanded"].append(seconds(expanded, module, query, units, mask))
                ta, te = (statistics.median(times[k]) * 1e3 for k in ("absorbed", "expanded"))
                print(f"| {columns:,} | {n} | {ta:.2f} | {te:.2f} | {te / ta:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
