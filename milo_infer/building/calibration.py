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
from milo_store.codecs.rate_distortion import ContextAttention

from ..models import attention_modules, attention_of, capture_queries, layer_rope_tables

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
    layout = attention_of(model.config).rope_layout(model.config)
    scaling = float(attention_modules(model)[0].scaling)

    def attend(i: int, keys: torch.Tensor) -> torch.Tensor:
        L, H, T, d = keys.shape
        rope = layer_rope_tables(model, T + int(positions.max()) + 1)
        out = []
        for layer in range(L):
            cos, sin = rope.layer(layer)
            cos, sin = cos.float().cpu(), sin.float().cpu()
            q = apply_rope(queries[layer].transpose(0, 1), cos[T + positions], sin[T + positions], **layout)
            k = apply_rope(keys[layer].float(), cos[:T], sin[:T], **layout)
            out.append(torch.softmax(q.reshape(H, -1, d) @ k.transpose(-1, -2) * scaling, dim=-1))
        return torch.stack(out)

    return attend


def calibration_query_ids(tokenizer, task, demos) -> list[list[int]]:
    """Token ids of `CALIBRATION_QUERIES` demonstrations' inputs written as queries, spread over ``demos``."""
    step = max(1, len(demos) // CALIBRATION_QUERIES)
    return [tokenizer(task.render_query(d.input), add_special_tokens=False)["input_ids"]
            for d in demos[::step][:CALIBRATION_QUERIES]]


# Errors in context (`milo eval` methods ``bits-<...>-ctx`` and ``bits-shared``, one pool for keys and values):
# each block's components are measured as the attention output over the context the model answers from
# takes their error (docs/results.md, "One pool for keys and values": it measured worse): the anchor's exact
# K/V and the block as one of CONTEXT_BLOCKS alike blocks (eval's k), queried by the last token of
# CONTEXT_QUERIES demonstrations' inputs (the token whose output picks the answer), in every layer.
CONTEXT_BLOCKS = 6
CONTEXT_QUERIES = 32


def context_attention(loaded, anchor_ids: list[int], anchor_kv: torch.Tensor, query_ids: list[list[int]],
                      blocks: int = CONTEXT_BLOCKS) -> Callable[[int, int, torch.Tensor, torch.Tensor], ContextAttention]:
    """``in_context(i, layer, keys, values)``: the calibration queries' `ContextAttention` in ``layer`` over
    block i's pre-RoPE keys and values [H, T, d], the block at the positions after the anchor (K/V
    ``anchor_kv`` [L, 2, H, A, d]) and the queries right after it, the softmax's mass shared with
    ``blocks`` - 1 more blocks that draw as much as this one."""
    model = loaded.model
    with torch.no_grad():
        last = [capture_queries(model, anchor_ids + ids)[:, -1:] for ids in query_ids]
    queries = torch.cat(last, dim=1).float()  # [L, M', Hq, d]
    offsets = torch.tensor([len(ids) - 1 for ids in query_ids])
    layout = attention_of(model.config).rope_layout(model.config)
    scaling = float(attention_modules(model)[0].scaling)
    anchor_kv = anchor_kv.float().cpu()
    A = anchor_kv.shape[-2]
    rope = {"rows": 0, "tables": None}  # grown to the longest block seen

    def in_context(i: int, layer: int, keys: torch.Tensor, values: torch.Tensor) -> ContextAttention:
        H, T, d = keys.shape
        n_rows = A + T + int(offsets.max()) + 1
        if n_rows > rope["rows"]:
            rope.update(rows=n_rows, tables=layer_rope_tables(model, n_rows))
        cos, sin = rope["tables"].layer(layer)
        cos, sin = cos.float().cpu(), sin.float().cpu()
        here = slice(A, A + T)
        q = apply_rope(queries[layer].transpose(0, 1), cos[A + T + offsets], sin[A + T + offsets], **layout)
        q = q.reshape(H, -1, d)  # [H, M, d]: query heads grouped by the KV head they read
        anchor_scores = q @ apply_rope(anchor_kv[layer, 0], cos[:A], sin[:A], **layout).transpose(-1, -2) * scaling
        scores = q @ apply_rope(keys.float(), cos[here], sin[here], **layout).transpose(-1, -2) * scaling
        top = torch.maximum(anchor_scores.amax(-1, keepdim=True) if A else scores.amax(-1, keepdim=True),
                            scores.amax(-1, keepdim=True))
        anchor_w, block_w = (anchor_scores - top).exp(), (scores - top).exp()
        total = anchor_w.sum(-1, keepdim=True) + blocks * block_w.sum(-1, keepdim=True)
        output = (anchor_w @ anchor_kv[layer, 1] + blocks * (block_w @ values.float())) / total

        def score_gradient(directions: torch.Tensor) -> torch.Tensor:
            n = directions.shape[1]
            rotated = apply_rope(directions.unsqueeze(2).expand(H, n, T, d), cos[here], sin[here], **layout)
            return torch.einsum("hmd,hntd->hmtn", q, rotated) * scaling

        return ContextAttention(probs=block_w / total, output=output, score_gradient=score_gradient)

    return in_context


def context_query_ids(tokenizer, task, demos) -> list[list[int]]:
    """Token ids of `CONTEXT_QUERIES` demonstrations' inputs written as queries, spread over ``demos``."""
    step = max(1, len(demos) // CONTEXT_QUERIES)
    return [tokenizer(task.render_query(d.input), add_special_tokens=False)["input_ids"]
            for d in demos[::step][:CONTEXT_QUERIES]]
