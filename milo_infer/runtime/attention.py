"""Attention over the paged cache: every row's tokens attend to that row's columns only.

Two ways, the same answer (tests/infer/runtime/test_attention.py holds them within 1e-4 in fp32):

* ``flex``: one FlexAttention call per layer for all rows. The packed queries are laid out as [rows, Hq,
  tokens, d] (each row's tokens padded to the step's longest, rows padded to a power of two, so a few
  shapes serve every step), keys and values are the whole pool [1, H, columns, d] (FlexAttention broadcasts
  it over the rows), and a block mask made from the rows' page tables names each row's pages: the pages
  before its first token's position in full, the rest masked by position, in the mask function
  (``owner`` and ``logical``: which row holds each page and at which of its pages). Compiled
  (``torch.compile``); uncompiled, FlexAttention materialises the whole score matrix, which the exactness
  tests can afford and serving cannot.
* ``rows``: one SDPA call per row (native GQA), over a view of the row's columns when its pages are
  consecutive, a gather of them when not. No compilation and no padding.

``Engine(attention="auto")`` runs ``flex`` on CUDA (where each SDPA call is a kernel launch, ~900 a step for 32
rows of a 28-layer model) and ``rows`` on the CPU, where there are no launches to save and compiled
FlexAttention's C++ kernel recompiles for every new shape (`tools/bench_engine.py --attention rows,flex`
measures both).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .cache import Pack
from .pages import PAGE_TOKENS, pages_for

ATTENTION = "milo_pages"
ATTENTIONS = ("auto", "flex", "rows")
Q_BLOCK = 128  # FlexAttention's query block
RECOMPILE_LIMIT = 64  # shapes: rows and tokens in powers of two, times the pool sizes a batch grows through


def choose_attention(name: str, device: torch.device) -> str:
    if name not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {name!r}")
    return name if name != "auto" else "flex" if device.type == "cuda" else "rows"


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, milo_pack=None, **kwargs):
    """The engine's attention (registered with transformers as ``milo_pages``): query [1, Hq, T, d] packed,
    key and value the pools [1, H, columns, d]. A forward without a milo pack (the model called by someone
    else while this implementation is selected) is plain SDPA."""
    if milo_pack is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    attend = flex_rows if milo_pack.attention == "flex" else sdpa_rows
    return attend(query, key, value, milo_pack, scaling).transpose(1, 2).contiguous(), None


def sdpa_rows(query, key, value, pack: Pack, scaling) -> torch.Tensor:
    """One SDPA call per row over its own columns: [1, Hq, T, d]. A row's columns are a view of the pools when its
    pages are consecutive, else gathered (``index_select``: 1.6x faster than indexing on this CPU, issue 47). A
    row's one decode token is attended as its KV heads' groups of query heads, [1, H, Hq / H, d] against [1, H,
    keys, d], with no mask to apply: the same scores as SDPA's GQA, which is ~1.1x slower for it here."""
    out = torch.empty_like(query)
    Hq, H, d = query.shape[1], key.shape[1], query.shape[3]
    for s in pack.segments:
        if s.run is not None:
            at = slice(s.run * PAGE_TOKENS, s.run * PAGE_TOKENS + s.keys)
            k, v = key[:, :, at], value[:, :, at]
        else:
            k, v = key.index_select(2, s.gather), value.index_select(2, s.gather)
        q = query[:, :, s.start:s.stop]
        if s.mask is None and s.stop - s.start == 1:
            out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(1, H, Hq // H, d), k, v, scale=scaling).reshape(1, Hq, 1, d)
        else:
            out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=s.mask, scale=scaling, enable_gqa=True)
    return out


def power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def flex_layout(pack: Pack, pool_pages: int, device) -> dict:
    """What every layer's FlexAttention call of this forward shares: where each row's tokens go in the padded
    query, the block mask, and which padded outputs are the tokens'. Host work is per row and query block; the
    [rows, 1, blocks, pool pages] indices are made on the device from the rows' page tables."""
    segments, P = pack.segments, pool_pages
    rows, tokens = power_of_two(len(segments)), power_of_two(max(s.stop - s.start for s in segments))
    q_blocks = -(-tokens // Q_BLOCK)
    T = segments[-1].stop
    index = torch.full((rows, tokens), T, dtype=torch.long)  # T: a zero query (padding)
    positions = torch.full((rows, tokens), -1, dtype=torch.int32)  # -1: sees nothing
    owner = torch.full((P,), -1, dtype=torch.int32)
    logical = torch.zeros(P, dtype=torch.int32)
    full = torch.zeros(rows, 1, q_blocks, dtype=torch.int32)
    partial = torch.zeros(rows, 1, q_blocks, dtype=torch.int32)
    widest = max(len(s.pages) for s in segments)
    tables = torch.zeros(rows, widest, dtype=torch.int32)
    for r, s in enumerate(segments):
        n = s.stop - s.start
        index[r, :n] = torch.arange(s.start, s.stop)
        positions[r, :n] = s.positions.to(torch.int32)
        pages = torch.tensor(s.pages)
        owner[pages] = r
        logical[pages] = torch.arange(len(pages), dtype=torch.int32)
        tables[r, :len(pages)] = pages.to(torch.int32)
        for b in range(q_blocks):
            seen = s.positions[b * Q_BLOCK:(b + 1) * Q_BLOCK]
            if len(seen):  # pages wholly before the block's first position are seen whole by all its tokens
                full[r, 0, b] = (int(seen.min()) + 1) // PAGE_TOKENS
                partial[r, 0, b] = pages_for(int(seen.max()) + 1) - full[r, 0, b]
    tables, full, partial = tables.to(device), full.to(device), partial.to(device)
    j = torch.arange(P, device=device)
    # each block's partial pages follow its full ones in the row's table; entries past its count are unused
    after = (full[:, 0, :, None].long() + j).clamp(max=widest - 1)  # [rows, blocks, P]
    partial_index = tables[:, None, :].expand(rows, q_blocks, widest).gather(2, after)[:, None].contiguous()
    full_index = tables[:, j % widest][:, None, None].expand(rows, 1, q_blocks, P).contiguous()
    owner, logical, positions = owner.to(device), logical.to(device), positions.to(device)

    def mask(b, h, q, kv):
        page = kv // PAGE_TOKENS
        return (owner[page] == b) & (logical[page] * PAGE_TOKENS + kv % PAGE_TOKENS <= positions[b, q])

    block_mask = BlockMask.from_kv_blocks(partial, partial_index, full, full_index, BLOCK_SIZE=(Q_BLOCK, PAGE_TOKENS),
                                          mask_mod=mask, seq_lengths=(tokens, P * PAGE_TOKENS),
                                          compute_q_blocks=False)
    taken = torch.cat([torch.arange(s.stop - s.start) + r * tokens for r, s in enumerate(segments)])
    return {"index": index.to(device), "block_mask": block_mask, "taken": taken.to(device), "shape": (rows, tokens)}


def flex_rows(query, key, value, pack: Pack, scaling, compiled: bool = True) -> torch.Tensor:
    """One FlexAttention call for every row: [1, Hq, T, d]."""
    layout = pack.scratch.get("flex")
    if layout is None:
        layout = pack.scratch["flex"] = flex_layout(pack, key.shape[2] // PAGE_TOKENS, query.device)
    rows, tokens = layout["shape"]
    Hq, T, d = query.shape[1:]
    padded = torch.cat([query[0], query.new_zeros(Hq, 1, d)], dim=1)  # [Hq, T + 1, d]
    q = padded[:, layout["index"]].transpose(0, 1)  # [rows, Hq, tokens, d]
    attend = compiled_flex(query.device.type) if compiled else flex_attention
    out = attend(q, key, value, block_mask=layout["block_mask"], scale=scaling, enable_gqa=True)
    out = out.transpose(1, 2).reshape(rows * tokens, Hq, d)[layout["taken"]]  # [T, Hq, d]
    return out.transpose(0, 1)[None]


@functools.cache
def compiled_flex(device_type: str):
    """FlexAttention compiled once per process: shapes stay static on the CPU (its dynamic-shape C++ kernel
    does not build in torch 2.13), dynamic where a shape changes on CUDA."""
    compiled = torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)

    def attend(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)
    return attend


AttentionInterface.register(ATTENTION, paged_attention)
