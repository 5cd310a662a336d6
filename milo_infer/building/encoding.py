"""The model's part of pass one: the corpus as token ids, grouped into blocks, the blocks grouped into
forward passes (`encoding_units`), and one forward pass over a batch of blocks that keeps each block's
own pre-RoPE K/V and, in a hybrid model, its linear layers' state sections (`encode_blocks`)."""
import random
from typing import NamedTuple

import torch

from ..models import capture_kv, media_problem, model_layout
from ..models.capture import attention_modules, capture_linear_inputs, linear_rule
from ..tasks.corpus import Demonstration, TaskSpec
from .config import BuildError


def group_blocks(n: int, block_size: int, order: str, seed: int) -> list[list[int]]:
    """Demonstration indices per block: seeded shuffle or corpus order, the last block may be short."""
    if order not in ("random", "corpus"):
        raise BuildError(f"unknown block order {order!r}; expected 'random' or 'corpus'")
    idx = list(range(n))
    if order == "random":
        random.Random(seed).shuffle(idx)
    return [idx[i:i + block_size] for i in range(0, n, block_size)]


def tokenize(tokenizer, task: TaskSpec, demos: list[Demonstration],
             media: dict[str, int] | None = None) -> tuple[list[int], list[list[int]]]:
    """Anchor ids (the task's system prompt and anchor, with the tokenizer's special prefix, if any) and each
    demonstration's ids alone; a `BuildError` where one holds a token of ``media`` (a multimodal checkpoint's image or
    video tokens: `models.media_tokens`)."""
    anchor = tokenizer(task.anchor_text, add_special_tokens=True).input_ids
    demo_ids = [tokenizer(task.render(d), add_special_tokens=False).input_ids for d in demos]
    named = [("the task's anchor", anchor), *((f"demonstration {d.id!r}", ids) for d, ids in zip(demos, demo_ids))]
    for what, ids in named:
        if problem := media_problem(media or {}, ids, what):
            raise BuildError(problem)
    return anchor, demo_ids


def encoding_units(blocks, encode_batch: int) -> list[list[int]]:
    """Blocks encoded together in one forward pass: runs of ``encode_batch`` of ``blocks`` (the blocks
    to encode, in block order: ``range(n)`` for a build).

    The runs depend only on the arguments, never on how many processes share them, so a block's
    K/V are computed from the same padded batch on one rank or many (byte-identical stores).
    """
    blocks = list(blocks)
    return [blocks[i:i + encode_batch] for i in range(0, len(blocks), encode_batch)]


class EncodedBlock(NamedTuple):
    """A block's pre-RoPE K and V, each [L, H, T, d] fp32 on its layers' grid, and each linear layer's state section
    (`milo_store.lowrank.BlockFactors.states`: layer -> fp32 values; empty where no layer is linear)."""
    keys: torch.Tensor
    values: torch.Tensor
    states: dict[int, torch.Tensor]


def encode_blocks(model, rows: list[tuple[list[int], int]]) -> list[EncodedBlock]:
    """Forward each row's ids in one batch; per row, its last ``captured`` tokens' pre-RoPE K and V on the model's
    device, on its layers' grid (`model_layout`), and each linear layer's state section over them, from the state
    zero (`delta_rule.block_section`: the block's own transition, as its K/V are its own).

    Rows are right-padded: under the causal mask a real token never attends to the padding after
    it, so no padding mask is needed and its positions are 0..n-1 exactly as in a one-row pass.
    Only the last position's logits are computed (the rest are never read).
    """
    longest = max(len(ids) for ids, _ in rows)
    batch = torch.zeros(len(rows), longest, dtype=torch.long)  # token 0 pads; what follows a row is never read
    for r, (ids, _) in enumerate(rows):
        batch[r, :len(ids)] = torch.tensor(ids)
    with capture_kv(model) as kv, capture_linear_inputs(model) as linear, torch.inference_mode():
        model(input_ids=batch.to(model.device), use_cache=False, logits_to_keep=1)
        modules = attention_modules(model) if linear else []
        layout = model_layout(model.config)
        states = [{l: linear_rule(layout.layers[l]).block_section(modules[l], hidden[r, :len(ids)], captured).cpu()
                   for l, hidden in linear.items()} for r, (ids, captured) in enumerate(rows)]
    return [EncodedBlock(*(x.float() for x in kv.grid(r, slice(len(ids) - captured, len(ids)), layout)), states[r])
            for r, (ids, captured) in enumerate(rows)]
