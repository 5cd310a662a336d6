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
each row's tokens are padded to powers of two here, and a flex batch hands its attention the pools' pages up to
the highest its rows reached in powers of two (`flex_pool_pages`; the pools themselves hold the whole budget), so
the compiles a process makes are bounded by those buckets, not by the steps (tests/infer/runtime/test_attention.py
counts them). Before, each pool size a batch grew to was a new shape (and the first GPU sweep, on an H200 on
2026-12-04, stalled after its first batch: the suspect, unconfirmed).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from milo_kernels.cpu import rope

from ..models.latent import absorbed_query, values_out
from .cache import HeldQueries, Pack
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
    index: int = 0  # the layer's: which RoPE tables turn a query to a held block


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, milo_pack=None,
                    sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """The engine's attention (registered with transformers as ``milo_pages``): query [1, Hq, T, d] packed,
    key and value the pools [1, H, columns, d] (an MLA layer's: its one token's expansion, unread; its pool of units is
    the pack's, `latent_attention`). A forward without a milo pack (the model called by someone else while this
    implementation is selected) is plain SDPA."""
    if milo_pack is None:
        if softcap is not None or s_aux is not None:
            raise ValueError("milo_pages attention outside the engine runs SDPA, which has no soft-cap or sinks")
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    layer = LayerAttention(scaling, sliding_window, softcap, s_aux, module.layer_idx)
    pack = milo_pack.attended(module.layer_idx)
    if module.layer_idx in milo_pack.latent:
        return latent_attention(module, query, milo_pack.latent[module.layer_idx], pack, layer), None
    attend = flex_rows if milo_pack.attention == "flex" else sdpa_rows
    return attend(query, key, value, pack, layer).transpose(1, 2).contiguous(), None


def latent_attention(module, query, pool, pack: Pack, layer: LayerAttention) -> torch.Tensor:
    """An MLA layer's attention [1, T, Hq, v_head_dim] over its pool of units [1, columns, rope + latent]
    (`milo_infer.models.latent`): every query head absorbed into one over the unit, which all share as one KV head,
    the unit's latent its value, then each head's W_uv. Per row (``rows``) whatever the engine's choice: FlexAttention
    is not run on it yet."""
    q = absorbed_query(module, query)
    units = pool[None]
    out = sdpa_rows(q, units, units[..., module.qk_rope_head_dim:], pack, layer)
    return values_out(module, out).transpose(1, 2).contiguous()


def sdpa_rows(query, key, value, pack: Pack, layer: LayerAttention | None) -> torch.Tensor:
    """One SDPA call per row over its own columns (the scores computed here where SDPA has no soft-cap or sinks):
    [1, Hq, T, dv] (dv: the values' width). A row's columns are a view of the pools when its pages are consecutive, else gathered
    (``index_select``: 1.6x faster than indexing on this CPU, issue 47). A row's one decode token with no mask
    to apply (no window) is attended as its KV heads' groups of query heads, [1, H, Hq / H, d] against [1, H,
    keys, d]: the same scores as SDPA's GQA, which is ~1.1x slower for it here. A window layer reads a row's columns
    from the first its earliest token's window reaches (a window of W over a long prefix: W columns, not all)."""
    layer = layer or LayerAttention()
    Hq, H, d, dv = query.shape[1], key.shape[1], query.shape[3], value.shape[3]
    out = query.new_empty(*query.shape[:3], dv)
    held = Merge.of(pack.held, query, dv)
    for s in pack.segments:
        # a window layer reads the columns from the first its earliest token's window reaches; a row placing held
        # blocks reads its own pages from its own columns' first
        lo = max(s.first, 0 if layer.window is None else int(s.positions.min()) - layer.window + 1)
        if s.run is not None:
            at = slice(s.run * PAGE_TOKENS + lo, s.run * PAGE_TOKENS + s.keys)
            k, v = key[:, :, at], value[:, :, at]
        else:
            at = s.gather[lo:] if lo else s.gather
            k, v = key.index_select(2, at), value.index_select(2, at)
        mask = s.mask[:, lo:] if s.mask is not None and lo else s.mask
        if layer.window is not None:
            columns = torch.arange(lo, s.keys, device=query.device)
            inside = columns[None, :] > s.positions.to(query.device)[:, None] - layer.window
            mask = inside if mask is None else mask & inside
        q = query[:, :, s.start:s.stop]
        if s.shared_at is not None:  # its own columns now, its held blocks' below: merged by log-sum-exp
            held.own(s.shared_at, *partial_attention(q[0], k[0], v[0], mask, layer))
        elif layer.softcap is not None or layer.sinks is not None:
            out[:, :, s.start:s.stop] = scored_attention(q, k, v, mask, layer)
        elif mask is None and s.stop - s.start == 1:
            out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(1, H, Hq // H, d), k, v, scale=layer.scaling).reshape(1, Hq, 1, dv)
        elif H == 1 and dv != d:  # one shared unit whose values are narrower than its keys (MLA's): every query head's
            # tokens as one head's, the mask repeated (SDPA's GQA would copy the unit per head into its math kernel)
            n = s.stop - s.start
            out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(1, 1, Hq * n, d), k, v, attn_mask=None if mask is None else mask.repeat(Hq, 1),
                scale=layer.scaling).reshape(1, Hq, n, dv)
        else:
            out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
    if held is not None:
        held.finish(out, query, key, value, layer)
    return out


def partial_attention(q, k, v, mask, layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [Hq, n, d] over k [H, C, d], v [H, C, dv] (GQA) in fp32, soft-capped as the layer says,
    and each query's log-sum-exp of its scores: what merges with its attention over other columns (`Merge`). ``mask``
    [n, C] (None: every column); each query must see a column. On the CPU without a soft-cap this is the kernel SDPA
    runs there, which returns the log-sum-exp beside the output (1.5x the scores written out, issue 54)."""
    Hq, n, d = q.shape
    H, C, dv = k.shape[0], k.shape[1], v.shape[2]
    scale = layer.scaling if layer.scaling is not None else d ** -0.5
    grouped = q.float().reshape(H, Hq // H * n, d)
    if mask is not None:
        mask = mask.expand(Hq // H, n, C).reshape(-1, C)
    if layer.softcap is None and q.device.type == "cpu" and dv == d:  # its kernel takes one head size (not MLA's)
        bias = None if mask is None else torch.zeros(mask.shape, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            grouped[None], k.float()[None], v.float()[None], 0.0, False, attn_mask=bias, scale=scale)
        return out[0].reshape(Hq, n, dv), lse[0].reshape(Hq, n)
    out, lse = softmax_parts(torch.bmm(grouped * scale, k.float().transpose(1, 2)), v.float(), mask, layer)
    return out.view(Hq, n, dv), lse.view(Hq, n)


def softmax_parts(scores, v, mask, layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of fp32 ``scores`` [..., m, C] (soft-capped as the layer says; ``mask`` broadcast to them, None: every
    column) times ``v`` [..., C, d], and each row's log-sum-exp. A row that sees nothing: log-sum-exp −inf, output
    not a number (callers never read one)."""
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top.masked_fill(torch.isinf(top), 0)).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v).div_(total), (top + total.log()).squeeze(-1)


ONE_GROUP = ("cuda",)  # device types whose held blocks are all padded into one call a layer (a launch is dear there;
# on the CPU one SDPA-kernel call a block on a view of its pages measured faster than padded calls, issue 54)


@dataclass
class PaddedBlocks:
    """Held blocks attended in one call: their pool columns [E, T] (padding: column 0), where each pair goes in [E × n]
    (``slot``; n: the most pairs one has), and what each padded pair sees (``mask`` [E, 1, G·n, T])."""
    n: int
    columns: torch.Tensor
    slot: torch.Tensor
    mask: torch.Tensor


@dataclass
class HeldReach:
    """What the layers of one window (None: every column) attend of a forward's held blocks: the pairs (indices into
    `HeldQueries`' arrays), each block with its run of them, each pair's first column seen in its block (None: every
    one), and, on a device of `ONE_GROUP`, all of them padded into one call (`padded`, made once a forward)."""
    pairs: torch.Tensor
    blocks: list
    low: torch.Tensor | None
    made: dict = field(default_factory=dict)  # per groups: layers of one window may differ in KV heads (Gemma 4)

    def padded(self, device, groups: int) -> PaddedBlocks:
        """Every block padded to the most pairs and tokens any has; ``groups``: the query heads per KV head."""
        if groups not in self.made:
            E = len(self.blocks)
            n, T = max(hi - lo for _, (lo, hi) in self.blocks), max(b.tokens for b, _ in self.blocks)
            columns = torch.zeros(E, T, dtype=torch.long, device=device)
            seen = torch.zeros(E, T, dtype=torch.bool, device=device)
            low = torch.zeros(E, n, dtype=torch.long, device=device)
            slot = torch.empty(len(self.pairs), dtype=torch.long, device=device)
            for e, (b, (lo, hi)) in enumerate(self.blocks):
                columns[e, :b.tokens] = b.indices(device)
                seen[e, :b.tokens] = True
                slot[lo:hi] = e * n + torch.arange(hi - lo, device=device)
                if self.low is not None:
                    low[e, :hi - lo] = self.low[lo:hi]
            mask = seen[:, None, :] & (torch.arange(T, device=device) >= low[:, :, None])  # [E, n, T]
            mask = mask[:, None].expand(E, groups, n, T).reshape(E, 1, groups * n, T)
            self.made[groups] = PaddedBlocks(n, columns, slot, mask)
        return self.made[groups]


def held_parts(q, reach: HeldReach, key, value, layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's part of the held blocks it attends, q [Hq, P, d] turned: [Hq, P, d] and its log-sum-exp [Hq, P]:
    one call a block (its pages' view), or on a device of `ONE_GROUP` every block in one padded call."""
    if q.device.type in ONE_GROUP:
        return padded_attention(q, reach.padded(q.device, q.shape[0] // key.shape[0]), key, value, layer)
    parts, sums = [], []
    for b, (lo, hi) in reach.blocks:
        mask = None if reach.low is None else torch.arange(b.tokens, device=q.device)[None, :] >= reach.low[lo:hi, None]
        o, s = partial_attention(q[:, lo:hi], b.of(key), b.of(value), mask, layer)
        parts.append(o)
        sums.append(s)
    return torch.cat(parts, dim=1), torch.cat(sums, dim=1)


def padded_attention(q, g: PaddedBlocks, key, value, layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of the held blocks padded into ``g`` for its pairs' queries q [Hq, p, d], [Hq, p, dv]: one product of
    every block's padded queries with its padded keys, the scores written out; padded queries see nothing and are
    dropped."""
    Hq, _, d = q.shape
    H, (E, T), n, dv = key.shape[0], g.columns.shape, g.n, value.shape[2]
    grouped = q.new_zeros(Hq, E * n, d, dtype=torch.float32)
    grouped[:, g.slot] = q.float()
    grouped = grouped.view(H, Hq // H, E, n, d).permute(2, 0, 1, 3, 4).reshape(E, H, Hq // H * n, d)
    k = key.index_select(1, g.columns.flatten()).view(H, E, T, d).transpose(0, 1).float()  # [E, H, T, d]
    v = value.index_select(1, g.columns.flatten()).view(H, E, T, dv).transpose(0, 1).float()
    scale = layer.scaling if layer.scaling is not None else d ** -0.5
    out, lse = softmax_parts(torch.matmul(grouped * scale, k.transpose(-1, -2)), v, g.mask, layer)
    out = out.reshape(E, H, Hq // H, n, dv).permute(1, 2, 0, 3, 4).reshape(Hq, E * n, dv)[:, g.slot]
    return out, lse.reshape(E, H, Hq // H, n).permute(1, 2, 0, 3).reshape(Hq, E * n)[:, g.slot]


class Merge:
    """The attention of the tokens whose rows place held blocks: over their own columns first (``own``), then over
    every held block they place, each block once for all its tokens, their queries turned back by the block's offset
    in their rows (``finish``: ⟨R(m)q, R(p+i)k⟩ = ⟨R(m−p)q, R(i)k⟩, and a block is held at positions 0..T-1); the
    parts merge by their log-sum-exps, and a sink logit (gpt-oss) joins once per token, at the end."""

    def __init__(self, held: HeldQueries, query: torch.Tensor, value_width: int | None = None):
        Hq, S = query.shape[1], len(held.packed)
        self.held = held
        self.acc = query.new_zeros(Hq, S, value_width or query.shape[3], dtype=torch.float32)
        self.lse = query.new_full((Hq, S), float("-inf"), dtype=torch.float32)

    @classmethod
    def of(cls, held: HeldQueries | None, query: torch.Tensor, value_width: int | None = None) -> "Merge | None":
        return None if held is None else cls(held, query, value_width)

    def own(self, at: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.acc[:, at:at + out.shape[1]] = out
        self.lse[:, at:at + out.shape[1]] = lse

    def finish(self, out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               layer: LayerAttention) -> None:
        """Merge every held block's part into the tokens' own and write them to ``out`` [1, Hq, T, d]."""
        held = self.held
        if layer.window not in held.reaches:
            held.reaches[layer.window] = self.held_reach(layer.window)
        reach = held.reaches[layer.window]
        if reach is not None:
            token = held.token[reach.pairs]
            cos, sin = held.rope.turn(layer.index)
            offset = held.offset[reach.pairs]
            q = rope(query[0][:, held.packed[token]].float(), cos[offset], -sin[offset],
                     **held.layers[layer.index].rope_layout())
            part, lse = held_parts(q, reach, key[0], value[0], layer)
            top = self.lse.scatter_reduce(1, token.expand_as(lse), lse, "amax")
            own = torch.exp(self.lse - top)
            weight = torch.exp(lse - top[:, token])
            total = own.index_add(1, token, weight)
            self.acc.mul_(own[..., None]).index_add_(1, token, part * weight[..., None]).div_(total[..., None])
            self.lse = top + torch.log(total)
        if layer.sinks is not None:
            self.acc.mul_(sink_share(self.lse, layer.sinks)[..., None])
        out[0][:, held.packed] = self.acc.to(out.dtype)

    def held_reach(self, window: int | None) -> HeldReach | None:
        """What a layer with ``window`` attends of the held blocks: a window sees a block's columns from its token's
        position − W + 1 on, and none of a block wholly before that. None when no pair is left."""
        held = self.held
        if window is None:
            return HeldReach(torch.arange(len(held.token), device=held.token.device),
                             [(b, (b.start, b.stop)) for b in held.blocks], None)
        low = held.position_host - window + 1 - held.offset_host  # the first column of its block a pair sees
        kept, blocks, at = [], [], 0
        for b in held.blocks:
            seen = torch.nonzero(low[b.start:b.stop] < b.tokens).flatten() + b.start
            if len(seen):
                kept.append(seen)
                blocks.append((b, (at, at + len(seen))))
                at += len(seen)
        if not kept:
            return None
        pairs = torch.cat(kept)
        first = low[pairs].clamp(min=0)
        return HeldReach(pairs.to(held.token.device), blocks, first.to(held.token.device) if bool(first.any()) else None)


def scored_attention(query, key, value, mask, layer: LayerAttention) -> torch.Tensor:
    """One row's attention [1, Hq, n, d] where SDPA takes no soft-cap or sinks: `partial_attention` (fp32), a sink
    logit per head joined by its log-sum-exp."""
    out, lse = partial_attention(query[0], key[0], value[0], mask, layer)
    if layer.sinks is not None:
        out = out * sink_share(lse, layer.sinks)[..., None]
    return out.to(query.dtype)[None]


def sink_share(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """What softmax over [scores, sink] leaves the scores' weights, 1 / (1 + e^(sink − lse)), for log-sum-exps
    [..., Hq, n] and a sink logit per head [Hq]."""
    return torch.sigmoid(lse.float() - sinks.float()[:, None])


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
    own_first = torch.tensor([s.first for s in segments] + [0] * (rows - len(segments)), dtype=torch.int32)
    skips = [s.first // PAGE_TOKENS for s in segments]  # a row placing held blocks: its table from its own pages on
    widest = max(len(s.pages) - skip for s, skip in zip(segments, skips))
    tables = torch.zeros(rows, widest, dtype=torch.int32)
    for r, (s, skip) in enumerate(zip(segments, skips)):
        n = s.stop - s.start
        index[r, :n] = torch.arange(s.start, s.stop)
        positions[r, :n] = s.positions.to(torch.int32)
        pages = torch.tensor(s.pages[skip:])
        owner[pages] = r
        logical[pages] = skip + torch.arange(len(pages), dtype=torch.int32)
        tables[r, :len(pages)] = pages.to(torch.int32)
        for b in range(q_blocks):
            seen = s.positions[b * Q_BLOCK:(b + 1) * Q_BLOCK]
            if not len(seen):
                continue
            if window is None and not s.first:  # pages wholly before the block's first position are seen whole
                full[r, 0, b] = first[r, 0, b] = (int(seen.min()) + 1) // PAGE_TOKENS
            else:  # indices into the row's table, which starts at its page ``skip``
                reach = 0 if window is None else max(0, int(seen.min()) - window + 1) // PAGE_TOKENS
                first[r, 0, b] = max(reach, skip) - skip
            partial[r, 0, b] = pages_for(int(seen.max()) + 1) - skip - first[r, 0, b]
    tables, full, first, partial = tables.to(device), full.to(device), first.to(device), partial.to(device)
    own_first = own_first.to(device)
    j = torch.arange(P, device=device)
    # each block's partial pages are its table's from ``first`` on; entries past its count are unused
    after = (first[:, 0, :, None].long() + j).clamp(max=widest - 1)  # [rows, blocks, P]
    partial_index = tables[:, None, :].expand(rows, q_blocks, widest).gather(2, after)[:, None].contiguous()
    full_index = tables[:, j % widest][:, None, None].expand(rows, 1, q_blocks, P).contiguous()
    owner, logical, positions = owner.to(device), logical.to(device), positions.to(device)

    def mask(b, h, q, kv):
        page = kv // PAGE_TOKENS
        column = logical[page] * PAGE_TOKENS + kv % PAGE_TOKENS
        return (owner[page] == b) & (column <= positions[b, q]) & (column >= own_first[b])

    def window_mask(b, h, q, kv):
        page = kv // PAGE_TOKENS
        column = logical[page] * PAGE_TOKENS + kv % PAGE_TOKENS
        return ((owner[page] == b) & (column <= positions[b, q]) & (column > positions[b, q] - window)
                & (column >= own_first[b]))

    block_mask = BlockMask.from_kv_blocks(partial, partial_index, full, full_index, BLOCK_SIZE=(Q_BLOCK, PAGE_TOKENS),
                                          mask_mod=mask if window is None else window_mask,
                                          seq_lengths=(tokens, P * PAGE_TOKENS), compute_q_blocks=False)
    taken = torch.cat([torch.arange(s.stop - s.start) + r * tokens for r, s in enumerate(segments)])
    return {"index": index.to(device), "block_mask": block_mask, "taken": taken.to(device), "shape": (rows, tokens)}


def flex_rows(query, key, value, pack: Pack, layer: LayerAttention, compiled: bool = True) -> torch.Tensor:
    """One FlexAttention call for every row: [1, Hq, T, d]. Sinks need the log-sum-exp, which compiled
    FlexAttention does not return on the CPU (torch 2.13): there a sink layer runs the per-row loop."""
    layer = layer or LayerAttention()
    if (layer.sinks is not None or pack.held is not None) and compiled and query.device.type == "cpu":
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
    aux = AuxRequest(lse=True) if layer.sinks is not None or pack.held is not None else None
    out = attend(q, key, value, score_mod=score_mod, block_mask=layout["block_mask"], scale=layer.scaling,
                 enable_gqa=True, return_aux=aux)
    held = None
    if aux is not None:
        out, lse = out[0], out[1].lse
        if pack.held is not None:  # the own columns' part of the rows placing held blocks, merged with theirs
            held = Merge(pack.held, query)
            lse_tokens = lse.transpose(1, 2).reshape(rows * tokens, Hq)[layout["taken"]].T  # [Hq, T]
            own = out.transpose(1, 2).reshape(rows * tokens, Hq, d)[layout["taken"]].transpose(0, 1)  # [Hq, T, d]
            held.own(0, own[:, pack.held.packed].float(), lse_tokens[:, pack.held.packed].float())
        if layer.sinks is not None:
            out = out * sink_share(lse, layer.sinks)[..., None].to(out.dtype)
    out = out.transpose(1, 2).reshape(rows * tokens, Hq, d)[layout["taken"]]  # [T, Hq, d]
    out = out.transpose(0, 1)[None]
    if held is not None:
        held.finish(out, query, key, value, layer)
    return out


def flex_pool_pages(pages: int, limit: int) -> int:
    """The pages a flex batch's attention is handed when its rows reached ``pages``: the next power of two, within
    the ``limit`` its pools hold (one more size), so few sizes are few compiled shapes."""
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
