"""The benchmark's workload without a real model or corpus: a model of a named shape (its family's config class
and sizes) with random weights, a byte-level tokenizer built in memory, and every method's store over synthetic
K/V on the model's layers (`milo_store.layers`: Gemma 4's per-layer shapes, K = V and shared layers too; a hybrid's
linear layers' state sections, random values: what they cost to store, read and compose, not what they mean).

Needs no files and no download, so tests and GPU runs can use it anywhere.
"""
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from milo_store import CompressionConfig, Staging, factorize_block, write_store
from milo_store.synthetic import synthetic_block_factors, synthetic_states

from .throughput import store_configs
from ..tasks.corpus import TaskSpec
from ..models import LoadedModel, identity_layout, model_identity

SHAPES = {
    # Qwen2.5-7B's decoder (vocab and positions included); random weights.
    "qwen2.5-7b": dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=300, max_position_embeddings=4096),
    # Gemma 4 E2B's decoder as shared/families-2026-notes.md gives it: 35 layers, sliding ones of a KV head of 256
    # and full ones of 512 in transformers' default 5:1 pattern (the last layer full), the last 20 attending earlier
    # layers' K/V; K = V on the full layers (attention_k_eq_v, on here to measure what it saves). Its vocabularies
    # cut to 4,096 (the byte tokenizer's ids; the layers are E2B's, and 262,144 per-layer input rows would be 9 GB of
    # random weights)
    "gemma4-e2b": dict(num_hidden_layers=35, hidden_size=1536, num_attention_heads=8, num_key_value_heads=1,
                       head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
                       num_kv_shared_layers=20, sliding_window=512, intermediate_size=6144, vocab_size=4096,
                       vocab_size_per_layer_input=4096, hidden_size_per_layer_input=256,
                       max_position_embeddings=32768),
    "gemma4-tiny": dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                        sliding_window=64, intermediate_size=128, vocab_size=300, vocab_size_per_layer_input=300,
                        hidden_size_per_layer_input=8, max_position_embeddings=4096,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    # DeepSeek-V2-Lite's attention (MLA: latent 512, rope key 64, 16 heads of 128 + 64, no query low rank) and dense
    # first layer, 27 layers; its experts cut to 6 routed of which every token takes 6 (its top-6 of 64) and its 2
    # shared, so a token's expert compute is the released model's (64 experts of random weights would be 58 GB);
    # vocabulary cut to 4,096
    "deepseek-v2-lite": dict(num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                             kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=6,
                             num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, vocab_size=4096,
                             max_position_embeddings=32768),
    # Qwen3.5-0.8B's text model: 18 Gated DeltaNet layers (16 key and 16 value heads of 128, a convolution of 4) and,
    # every fourth layer, attention of 2 KV heads of 256 with a quarter of the head rotating; vocabulary cut to 4,096
    "qwen3.5-0.8b": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=256, intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         full_attention_interval=4, vocab_size=4096, max_position_embeddings=32768),
    "qwen3.5-tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, vocab_size=300,
                         max_position_embeddings=4096),
}
CONFIG_CLASS = {"gemma4-e2b": "Gemma4TextConfig", "gemma4-tiny": "Gemma4TextConfig",
                "deepseek-v2-lite": "DeepseekV2Config", "qwen3.5-0.8b": "Qwen3_5TextConfig",
                "qwen3.5-tiny": "Qwen3_5TextConfig"}  # the others: Qwen2Config
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
    """A model of a named shape (`SHAPES`) with random weights, initialised directly on ``device``."""
    import transformers

    config = getattr(transformers, CONFIG_CLASS.get(shape, "Qwen2Config"))(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), identity=model_identity(model))


def device_model(shape: str, device=None) -> LoadedModel:
    """`random_model` on ``device`` (default the CPU) in the dtype a benchmark runs there: bf16 on a GPU, fp32 on
    a CPU. What `milo bench --synthetic SHAPE` builds its stores for and `--model synthetic:SHAPE` serves."""
    device = torch.device(device or "cpu")
    return random_model(shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)


def synthetic_stores(root, loaded: LoadedModel, *, demos: int, block_size: int, demo_tokens: int, ratios,
                     seed: int = 0, bits_ratios=(), methods: str = "all", device=None,
                     workers: int = 4, token_ids: bool = True) -> dict[str, Path]:
    """Every method's store over the same synthetic K/V, with the attrs a session checks (model, task).

    Each block holds ``block_size`` fake demonstrations of ``demo_tokens`` tokens about one topic word,
    so BM25 retrieval of a query naming topics picks distinct blocks; the stores keep token ids (the
    demonstrations' text, `demonstration_token_ids`) for the ``prefill`` method (``token_ids=False``: none, as
    a store written before they were kept). ``methods``: "all" (the full store
    and MILO's), or "milo" (MILO's alone: no identity staging). ``bits_ratios``: also a bits-codec store
    (`bits-r<ρ>`) at each, its channel weights drawn at random.

    Built fast (issue 55: 64 blocks of Qwen2.5-7B's shape took 200 s): each block is drawn on ``device``
    (default: the GPU when there is one) with its SVD known from the draw (`synthetic_block_factors`: no SVD
    runs), staged by ``workers`` threads while the next block is drawn, and the stores are written in
    parallel. The same seed gives the same K/V on the CPU as `synthetic_block_kv` (the old path); a GPU's
    generator draws other numbers of the same spectrum.
    """
    root = Path(root)
    ident = loaded.identity
    layout = identity_layout(ident)
    n_blocks = -(-demos // block_size)
    task = TaskSpec(name="synthetic", template="Input: {input}\nLabel: {output}\n", anchor="Label each input.",
                    answer_kind="label", labels=SYNTHETIC_LABELS)
    anchor_ids = loaded.tokenizer(task.anchor, add_special_tokens=True).input_ids
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokens = [demo_tokens * min(block_size, demos - b * block_size) for b in range(n_blocks)]
    codecs = ("identity", "svd") if methods == "all" else ("svd",)
    if methods not in ("all", "milo"):
        raise ValueError(f"methods must be 'all' or 'milo', got {methods!r}")
    stagings = {c: Staging(root / f"staging-{c}", {"synthetic": seed, "codec": c, "layout": str(layout),
                                                   "tokens": tokens, "draw": f"factors on {device.type}"})
                for c in codecs}
    g = torch.Generator(device).manual_seed(seed)
    states = torch.Generator().manual_seed(seed + 1)  # a hybrid's linear layers' sections (none drawn elsewhere)
    with ThreadPoolExecutor(workers) as pool:
        pending = []
        for b, t in enumerate(tokens):
            factors, k, v = synthetic_block_factors(layout, t, g)  # drawn even when staged: the next block's draws
            drawn = synthetic_states(layout, states)
            if all(s.has(b) for s in stagings.values()):
                continue
            staged = {"svd": factors}
            if "identity" in stagings:
                staged["identity"] = factorize_block(k, v, codec="identity", layout=layout)
            for c, f in staged.items():
                f = dataclasses.replace(f, A=f.A.cpu(), S=f.S.cpu(), B=f.B.cpu(), states=drawn)
                pending.append(pool.submit(stagings[c].put, b, f))
            while len(pending) > 2 * workers:  # bounded: the host holds a few blocks at most
                pending.pop(0).result()
        for f in pending:
            f.result()
    examples = {"input": [f"demonstration {i} about topic{i // block_size}" for i in range(demos)],
                "output": [SYNTHETIC_LABELS[i % len(SYNTHETIC_LABELS)] for i in range(demos)],
                "id": [str(i) for i in range(demos)], "block": [i // block_size for i in range(demos)]}
    ids = demonstration_token_ids(loaded.tokenizer, task, examples, demo_tokens) if token_ids else None
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randn(layout.num_layers, 2, layout.num_kv_heads, len(anchor_ids), layout.head_dim, generator=g)
    attrs = {"model": ident, "task": dataclasses.asdict(task),
             "build": {"block_size": block_size, "synthetic": True, "anchor_token_ids": anchor_ids}}
    weights = torch.exp(0.5 * torch.randn(layout.num_layers, 2, layout.num_kv_heads, layout.head_dim, generator=g))
    gain = None  # K = V layers' key gains (a random model's key norms' weights: drawn too)
    if any(spec.keys_from_values for spec in layout.layers):
        gain = torch.exp(0.1 * torch.randn(layout.num_layers, layout.head_dim, generator=g))
    anchor_states = synthetic_states(layout, states)
    configs = {name: (config, {}) for name, config in store_configs(ratios, query_aware=False).items()
               if config.codec in stagings}
    configs.update({f"bits-r{ratio}": (CompressionConfig(codec="bits", ratio=ratio, query_aware=True),
                                       {"channel_scale": weights}) for ratio in bits_ratios})
    with ThreadPoolExecutor(min(workers, len(configs))) as pool:
        written = {name: pool.submit(write_store, root / name, stagings["svd" if config.codec != "identity" else "identity"],
                                     n_blocks, layout, config, attrs=attrs, anchor_kv=anchor, key_gain=gain,
                                     anchor_states=anchor_states,
                                     examples=examples, token_ids=ids, force=True, **extra)
                   for name, (config, extra) in configs.items()}
        return {name: future.result() for name, future in written.items()}


def demonstration_token_ids(tokenizer, task: TaskSpec, examples: dict, demo_tokens: int) -> np.ndarray:
    """The token ids a store keeps for its blocks (what a ``prefill`` request feeds the model): each
    demonstration's text in the task's template, cut or repeated to its ``demo_tokens`` tokens."""
    ids = []
    for text, label in zip(examples["input"], examples["output"]):
        own = tokenizer(task.template.format(input=text, output=label), add_special_tokens=False).input_ids
        ids += (own * -(-demo_tokens // len(own)))[:demo_tokens]
    return np.asarray(ids, dtype=np.int32)


def synthetic_queries(n: int, n_blocks: int, k: int) -> list[str]:
    """Queries naming k topics each, rotating through the blocks."""
    return [" ".join(f"topic{(q * k + j) % n_blocks}" for j in range(k)) + f" question {q}" for q in range(n)]
