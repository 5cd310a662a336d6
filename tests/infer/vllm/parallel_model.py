"""A small random-weight Llama whose 2 KV heads split over 2 tensor-parallel ranks, and stores built from it.

Written as a Hugging Face directory (the default model's tokenizer, so vLLM tokenizes as milo does),
as another engine loads it; the stores are `milo build`'s (`encode_once`) over a synthetic corpus whose
queries share words with the demonstrations, so retrieval picks blocks by meaning. Answers are free-form
(numbers): a label constraint is not one engine-independent rule for a random model (vLLM's structured
outputs allow any tokenization of a label, milo's trie its own), greedy decoding is.
"""
from pathlib import Path

import torch

from milo_infer.building.config import BuildConfig, default_compression
from milo_infer.building.shared_staging import encode_once
from milo_infer.models import LoadedModel, load_model
from milo_infer.tasks.corpus import Demonstration, TaskSpec

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048,
             initializer_range=0.1)  # wider than the default 0.02: logits far apart, so greedy answers are no ties
TOPICS = ("refund", "card", "transfer", "pin", "cash", "fee", "limit", "account")
TASK = TaskSpec(name="topics", template="Message: {input}\nTopic: {output}\n", anchor="Number each message's topic.",
                answer_kind="number")
SHOTS, BLOCK, CONTEXT = 64, 8, 2  # 8 blocks of 8 demonstrations, each encoded after the 2 before it


def write_model(path: Path, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, **SHAPE)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def demonstrations(n: int = SHOTS, offset: int = 0) -> list[Demonstration]:
    words = ("please", "about", "my", "today", "again", "why", "the", "help")
    return [Demonstration(input=f"{words[i % 8]} {TOPICS[(i * 3) % 8]} question {i} {words[(i * 5) % 8]} "
                                f"{TOPICS[(i * 7) % 8]}", output=str((i * 3) % 8), id=str(i))
            for i in range(offset, offset + n)]


def queries(n: int) -> list[str]:
    """Texts unlike any demonstration that still share its words (held-out demonstrations)."""
    return [d.input for d in demonstrations(n, offset=SHOTS)]


def build_stores(model: LoadedModel, root: Path) -> dict[str, Path]:
    """``raw`` (every unit raw, fp32: the identity), ``r05`` (what `milo build --ratio 0.5` writes) and ``bits``
    (the bits codec at ratio 0.125, decoded on the host at read)."""
    configs = {"raw": default_compression(1.0, codec="raw", dtype="float32"), "r05": default_compression(0.5),
               "bits": default_compression(0.125, codec="bits")}
    encode_once(model, demonstrations(), TASK, BuildConfig(block_size=BLOCK, context_blocks=CONTEXT), configs, root,
                progress=False)
    return {name: root / name for name in configs}


def load(path: Path) -> LoadedModel:
    return load_model(path)
