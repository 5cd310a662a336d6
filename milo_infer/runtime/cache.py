"""The slot K/V cache: every row of a running batch owns a slot, and nothing ever moves between slots.

gpt-fast style, vLLM-scheduler spirit: each layer's K/V buffers [slots, H, capacity, d] are allocated once
per batch (``torch.empty``: on a CPU, pages never written cost no memory; nothing is zero-filled). In a
slot, a token's column is its RoPE position, so a row's prefix rebuilt at positions [0, P) lands in columns
[0, P) (`PrefixRebuild.fill` writes straight into the row's slot), a recomputed prefix token overwrites its
own rebuilt column with its fresh K/V, and the query and answer follow at their positions. A forward
feeds a `Pack`: every row's new tokens concatenated into one sequence; ``update`` first runs the fills of
rows joining in this forward, then scatters each new token's K/V into (its row's slot, its position), and
`slot_attention` attends each row's tokens to that row's columns only. A row that joins or leaves touches
its own slot only: no other row's K/V is copied.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

Fill = Callable[..., None]  # fill(layer, k_buf, v_buf, slots): rebuild prefixes into those slots
ATTENTION = "milo_slots"


@dataclass
class Segment:
    """One row's tokens in a pack: ``start:stop`` of the packed sequence, its slot, the columns [0, keys) it
    reads, and the bool mask [tokens, keys] it needs (None: every column, i.e. one token at the end)."""
    slot: int
    start: int
    stop: int
    keys: int
    mask: torch.Tensor | None


@dataclass
class Pack:
    """What one forward feeds: each row's segment, every token's (slot, column), and the prefixes to rebuild
    (fill, their slots) before the first write of each layer."""
    segments: list[Segment]
    slots: torch.Tensor  # int64 [T]
    columns: torch.Tensor  # int64 [T]
    fills: list[tuple[Fill, list[int]]] = field(default_factory=list)


class SlotLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, index: int, cache: "SlotCache", slots: int, capacity: int, shape, dtype, device):
        super().__init__()
        H, d = shape
        # a proxy, not a reference: a cycle would keep every slot's buffers (gigabytes) alive after the batch
        # ends, until the garbage collector next ran
        self.index, self.cache = index, weakref.proxy(cache)
        self.k_buf = torch.empty(slots, H, capacity, d, dtype=dtype, device=device)
        self.v_buf = torch.empty_like(self.k_buf)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """Rebuild the joining rows' prefixes of this layer, write the new tokens' K/V at (slot, position), and
        hand the whole buffers to `slot_attention` (which reads each row's own columns)."""
        pack = self.cache.pack
        for fill, slots in pack.fills:
            fill(self.index, self.k_buf, self.v_buf, slots)
        self.k_buf[pack.slots, :, pack.columns] = key_states[0].transpose(0, 1)
        self.v_buf[pack.slots, :, pack.columns] = value_states[0].transpose(0, 1)
        self.cache.updated += 1
        return self.k_buf, self.v_buf

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.k_buf.shape[2], 0

    def get_seq_length(self) -> int:
        """Rows have lengths of their own: the engine always passes every token's position."""
        return 0

    def get_max_length(self) -> int:
        return self.k_buf.shape[2]


class SlotCache(Cache):
    """One SlotLayer per model layer; ``pack`` is the forward in flight, ``updated`` counts the layers it wrote
    (a model that ignored the cache writes none)."""

    def __init__(self, num_layers: int, slots: int, capacity: int, shape, dtype, device):
        super().__init__(layers=[SlotLayer(l, self, slots, capacity, shape, dtype, device) for l in range(num_layers)])
        self.pack: Pack | None = None
        self.updated = 0

    @property
    def column_bytes(self) -> int:
        """Bytes one column of one slot takes, K and V of every layer."""
        k = self.layers[0].k_buf
        return 2 * len(self.layers) * k.shape[1] * k.shape[3] * k.element_size()


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, milo_pack=None, **kwargs):
    """Each row's tokens attend to its own slot's columns [0, keys): SDPA with native GQA (no repeated KV
    heads), a bool mask only where a row feeds several tokens. A forward without a milo pack (the model
    called by someone else while this implementation is selected) is plain SDPA."""
    if milo_pack is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = torch.empty_like(query)
    for s in milo_pack.segments:
        out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s.start:s.stop], key[s.slot:s.slot + 1, :, :s.keys], value[s.slot:s.slot + 1, :, :s.keys],
            attn_mask=s.mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, slot_attention)
