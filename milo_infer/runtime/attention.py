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

Each layer attends as its module says, from what it hands its attention function: ``sliding_window`` (a token
sees its last W positions only: column c of a token at position p when p − W < c ≤ p), ``softcap`` (Gemma 2's
scores capped to cap·tanh(score/cap)), ``s_aux`` (gpt-oss's per-head sink logit, one more softmax entry whose value
is nothing) and ``scaling`` (Gemma's query_pre_attn_scalar). ``rows`` runs SDPA where none of the first three is
there, else the scores in fp32 itself; ``flex`` narrows its block mask to the window's pages, caps in a score
modifier and folds the sink in from the log-sum-exp FlexAttention returns.

``Engine(attention="auto")`` runs ``flex`` on CUDA (where each SDPA call is a kernel launch, ~900 a step for 32
rows of a 28-layer model) and ``rows`` on the CPU, where there are no launches to save (`tools/bench_engine.py
--attention rows,flex` measures both).

Compiled FlexAttention is compiled for static shapes, on the CPU and on CUDA alike, once per shape: the rows and
each row's tokens are padded to powers of two here, and the engine sizes a flex batch's pools in powers of two
of pages (`flex_pool_pages`), so the compiles a process makes are bounded by those buckets, not by the steps
(tests/infer/runtime/test_attention.py counts them). Before, each pool size a batch grew to was a new shape (and
the first GPU sweep, on an H200 on 2026-12-04, stalled after its first batch: the suspect, unconfirmed).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .cache import Pack
from .pages import PAGE_TOKENS, pages_for

ATTENTION = "milo_pages"
ATTENTIONS = ("auto", "flex", "rows")
Q_BLOCK = 128  # FlexAttention's query block
RECOMPILE_LIMIT = 256  # shapes: rows, tokens and pool pages in powers of two (and a window layer's own); past
# it dynamo would run FlexAttention uncompiled, materialising every score


def choose_attention(name: str, device: torch.device) -> str:
    if name not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {name!r}")
    return name if name != "auto" else "flex" if device.type == "cuda" else "rows"


@dataclass(frozen=True)
class LayerAttention:
    """What a layer's attention adds to plain causal softmax attention (see the module's docstring)."""
    scaling: float | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, milo_pack=None,
                    sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """The engine's attention (registered with transformers as ``milo_pages``): query [1, Hq, T, d] packed,
    key and value the pools [1, H, columns, d]. A forward without a milo pack (the model called by someone
    else while this implementation is selected) is plain SDPA."""
    if milo_pack is None:
        if softcap is not None or s_aux is not None:
            raise ValueError("milo_pages attention outside the engine runs SDPA, which has no soft-cap or sinks")
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    layer = LayerAttention(scaling, sliding_window, softcap, s_aux)
    attend = flex_rows if milo_pack.attention == "flex" else sdpa_rows
    return attend(query, key, value, milo_pack.attended(), layer).transpose(1, 2).contiguous(), None


def sdpa_rows(query, key, value, pack: Pack, layer: LayerAttention | None) -> torch.Tensor:
    """One SDPA call per row over its own columns (the scores computed here where SDPA has no soft-cap or sinks):
    [1, Hq, T, d]. A row's columns are a view of the pools when its pages are consecutive, else gathered
    (``index_select``: 1.6x faster than indexing on this CPU, issue 47). A row's one decode token with no mask
    to apply (no window) is attended as its KV heads' groups of query heads, [1, H, Hq / H, d] against [1, H,
    keys, d]: the same scores as SDPA's GQA, which is ~1.1x slower for it here. A window layer reads a row's columns
    from the first its earliest token's window reaches (a window of W over a long prefix: W columns, not all)."""
    layer = layer or LayerAttention()
    out = torch.empty_like(query)
    Hq, H, d = query.shape[1], key.shape[1], query.shape[3]
    for s in pack.segments:
        # a window layer reads the columns from the first its earliest token's window reaches
        lo = 0 if layer.window is None else max(0, int(s.positions.min()) - layer.window + 1)
        if s.run is not None:
            at = slice(s.run * PAGE_TOKENS + lo, s.run * PAGE_TOKENS + s.keys)
            k, v = key[:, :, at], value[:, :, at]
        else:
            at = s.gather[lo:] if lo else s.gather
            k, v = key.index_select(2, at), value.index_select(2, at)
        mask = s.mask
        if layer.window is not None:
            columns = torch.arange(lo, s.keys, device=query.device)
            inside = columns[None, :] > s.positions.to(query.device)[:, None] - layer.window
            mask = inside if mask is None else mask[:, lo:] & inside
        q = query[:, :, s.start:s.stop]
        if layer.softcap is not None or layer.sinks is not None:
            out[:, :, s.start:s.stop] = scored_attention(q, k, v, mask, layer)
        elif mask is None and s.stop - s.start == 1:
            out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(1, H, Hq // H, d), k, v, scale=layer.scaling).reshape(1, Hq, 1, d)
        else:
            out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
    return out


def scored_attention(query, key, value, mask, layer: LayerAttention) -> torch.Tensor:
    """Softmax attention written out, in fp32: the scores soft-capped, a sink logit per head beside them."""
    n_rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(n_rep, dim=1).float()
    v = value.repeat_interleave(n_rep, dim=1).float()
    scale = layer.scaling if layer.scaling is not None else query.shape[-1] ** -0.5
    scores = query.float() @ k.transpose(-1, -2) * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        weights = scores.softmax(dim=-1)
    return (weights @ v).to(query.dtype)


def power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def flex_layout(pack: Pack, pool_pages: int, device, window: int | None = None) -> dict:
    """What every layer's FlexAttention call of this forward with this ``window`` shares: where each row's tokens go
    in the padded query, the block mask, and which padded outputs are the tokens'. Host work is per row and query
    block; the [rows, 1, blocks, pool pages] indices are made on the device from the rows' page tables. A window
    layer's blocks see no page whole: their pages start at the first one the block's earliest token still sees."""
    segments, P = pack.segments, pool_pages
    rows, tokens = power_of_two(len(segments)), power_of_two(max(s.stop - s.start for s in segments))
    q_blocks = -(-tokens // Q_BLOCK)
    T = segments[-1].stop
    index = torch.full((rows, tokens), T, dtype=torch.long)  # T: a zero query (padding)
    positions = torch.full((rows, tokens), -1, dtype=torch.int32)  # -1: sees nothing
    owner = torch.full((P,), -1, dtype=torch.int32)
    logical = torch.zeros(P, dtype=torch.int32)
    full = torch.zeros(rows, 1, q_blocks, dtype=torch.int32)
    first = torch.zeros(rows, 1, q_blocks, dtype=torch.int32)  # where in the row's table the partial pages start
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
            if not len(seen):
                continue
            if window is None:  # pages wholly before the block's first position are seen whole by all its tokens
                full[r, 0, b] = first[r, 0, b] = (int(seen.min()) + 1) // PAGE_TOKENS
            else:
                first[r, 0, b] = max(0, int(seen.min()) - window + 1) // PAGE_TOKENS
            partial[r, 0, b] = pages_for(int(seen.max()) + 1) - first[r, 0, b]
    tables, full, first, partial = tables.to(device), full.to(device), first.to(device), partial.to(device)
    j = torch.arange(P, device=device)
    # each block's partial pages are its table's from ``first`` on; entries past its count are unused
    after = (first[:, 0, :, None].long() + j).clamp(max=widest - 1)  # [rows, blocks, P]
    partial_index = tables[:, None, :].expand(rows, q_blocks, widest).gather(2, after)[:, None].contiguous()
    full_index = tables[:, j % widest][:, None, None].expand(rows, 1, q_blocks, P).contiguous()
    owner, logical, positions = owner.to(device), logical.to(device), positions.to(device)

    def mask(b, h, q, kv):
        page = kv // PAGE_TOKENS
        column = logical[page] * PAGE_TOKENS + kv % PAGE_TOKENS
        return (owner[page] == b) & (column <= positions[b, q])

    def window_mask(b, h, q, kv):
        page = kv // PAGE_TOKENS
        column = logical[page] * PAGE_TOKENS + kv % PAGE_TOKENS
        return (owner[page] == b) & (column <= positions[b, q]) & (column > positions[b, q] - window)

    block_mask = BlockMask.from_kv_blocks(partial, partial_index, full, full_index, BLOCK_SIZE=(Q_BLOCK, PAGE_TOKENS),
                                          mask_mod=mask if window is None else window_mask,
                                          seq_lengths=(tokens, P * PAGE_TOKENS), compute_q_blocks=False)
    taken = torch.cat([torch.arange(s.stop - s.start) + r * tokens for r, s in enumerate(segments)])
    return {"index": index.to(device), "block_mask": block_mask, "taken": taken.to(device), "shape": (rows, tokens)}


def flex_rows(query, key, value, pack: Pack, layer: LayerAttention, compiled: bool = True) -> torch.Tensor:
    """One FlexAttention call for every row: [1, Hq, T, d]. Sinks need the log-sum-exp, which compiled
    FlexAttention does not return on the CPU (torch 2.13): there a sink layer runs the per-row loop."""
    layer = layer or LayerAttention()
    if layer.sinks is not None and compiled and query.device.type == "cpu":
        return sdpa_rows(query, key, value, pack, layer)
    name = "flex" if layer.window is None else f"flex window {layer.window}"
    layout = pack.scratch.get(name)
    if layout is None:
        layout = pack.scratch[name] = flex_layout(pack, key.shape[2] // PAGE_TOKENS, query.device, layer.window)
    rows, tokens = layout["shape"]
    Hq, T, d = query.shape[1:]
    padded = torch.cat([query[0], query.new_zeros(Hq, 1, d)], dim=1)  # [Hq, T + 1, d]
    q = padded[:, layout["index"]].transpose(0, 1)  # [rows, Hq, tokens, d]
    attend = compiled_flex(query.device.type) if compiled else flex_attention
    score_mod = None
    if layer.softcap is not None:
        cap = layer.softcap

        def score_mod(score, b, h, q_index, kv_index):
            return torch.tanh(score / cap) * cap
    aux = AuxRequest(lse=True) if layer.sinks is not None else None
    out = attend(q, key, value, score_mod=score_mod, block_mask=layout["block_mask"], scale=layer.scaling,
                 enable_gqa=True, return_aux=aux)
    if aux is not None:  # softmax over [scores, sink]: the scores' weights shrink by 1 / (1 + e^(sink - lse))
        out, lse = out[0], out[1].lse
        out = out * torch.sigmoid(lse.float() - layer.sinks.float().reshape(1, -1, 1))[..., None].to(out.dtype)
    out = out.transpose(1, 2).reshape(rows * tokens, Hq, d)[layout["taken"]]  # [T, Hq, d]
    return out.transpose(0, 1)[None]


def flex_pool_pages(pages: int, limit: int) -> int:
    """The pages a flex batch's pools hold when they must hold ``pages``: the next power of two, within the
    ``limit`` the KV budget sets (one more size), so the pools' few sizes are few compiled shapes."""
    return min(power_of_two(pages), max(pages, limit))


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process (compiled FlexAttention is the engine's only compiled code):
    what a benchmark reports beside its times, and what a test bounds."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@functools.cache
def compiled_flex(device_type: str):
    """FlexAttention compiled once per process, for static shapes (``dynamic=False``; the CPU's dynamic-shape
    C++ kernel does not build in torch 2.13, and on CUDA automatic dynamic shapes would recompile once more per
    dimension and then run a kernel for any size): the buckets bound the shapes (the module's docstring)."""
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                        accumulated_recompile_limit=4 * RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)
    return attend


AttentionInterface.register(ATTENTION, paged_attention)
