"""Calibration attention for codecs that measure a value component's error as attention sees it.

The issue 45 study (docs/results.md, "Past 4×") found the attention output's error, not the values'
squared error, to be what decides where a value's bits go: rounding noise that attention averages away
costs little, a dropped component's content on the tokens a query attends to costs its full size. A
build measures it with a few demonstrations' inputs written as queries (`CALIBRATION_QUERIES`, spread over
the corpus), each after the store's anchor, at the positions that follow a block, attending over that
block's exact keys alone (softmax over the block). These demonstrations are in the store: the study's
were not (a demonstration attends most to its own copy; that copy is 1 of ~30 in its block).
"""
from __future__ import annotations

from typing import Callable

import torch

from milo_kernels.naive import apply_rope

from ..models import attention_of, capture_queries, decoder_layers, layer_rope_tables

CALIBRATION_QUERIES = 8


def value_attention(loaded, anchor_ids: list[int], query_ids: list[list[int]]
                    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """``attend(i, keys)``: the calibration queries' attention [L, H, M, T] over a block's pre-RoPE keys
    [L, H, T, d] (query heads grouped by the KV head they read, M rows per KV head)."""
    model = loaded.model
    with torch.no_grad():
        captured = [capture_queries(model, anchor_ids + ids)[:, len(anchor_ids):] for ids in query_ids]
    queries = torch.cat(captured, dim=1).float()  # [L, M, Hq, d]
    positions = torch.cat([torch.arange(len(ids)) for ids in query_ids])
    interleaved = attention_of(model.config).interleaved
    scaling = float(decoder_layers(model)[0].self_attn.scaling)

    def attend(i: int, keys: torch.Tensor) -> torch.Tensor:
        L, H, T, d = keys.shape
        rope = layer_rope_tables(model, T + int(positions.max()) + 1)
        out = []
        for layer in range(L):
            cos, sin = rope.layer(layer)
            cos, sin = cos.float().cpu(), sin.float().cpu()
            q = apply_rope(queries[layer].transpose(0, 1), cos[T + positions], sin[T + positions], interleaved)
            k = apply_rope(keys[layer].float(), cos[:T], sin[:T], interleaved)
            out.append(torch.softmax(q.reshape(H, -1, d) @ k.transpose(-1, -2) * scaling, dim=-1))
        return torch.stack(out)

    return attend


def calibration_query_ids(tokenizer, task, demos) -> list[list[int]]:
    """Token ids of `CALIBRATION_QUERIES` demonstrations' inputs written as queries, spread over ``demos``."""
    step = max(1, len(demos) // CALIBRATION_QUERIES)
    return [tokenizer(task.render_query(d.input), add_special_tokens=False)["input_ids"]
            for d in demos[::step][:CALIBRATION_QUERIES]]
