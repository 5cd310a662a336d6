"""A transformers cache for a batch of rows whose prefixes (anchor + retrieved blocks) are rebuilt from stores.

gpt-fast style: each layer owns preallocated K/V buffers [B, H, capacity, d] and one ``update``. The
first ``update`` of a layer fills every row's prefix by calling ``fill(layer, k, v)`` (reconstruction
through ``milo_kernels.reconstruct_layer``), so the prefix of layer l+1 is rebuilt only when the model
gets there, while the prefetcher already moves its factors.

Rows share the buffer's columns: every forward appends its tokens at the same columns for all rows,
and which columns a row may attend to is the batch's ``valid`` mask [B, capacity] (a row's prefix
takes columns [0, P_r); a shorter prefix leaves a masked gap). Keys carry their RoPE positions
already (stored keys are rotated at rebuild, new ones by the model at explicit position ids), and
attention does not care in which column a key sits, so rows of any prefix length are batched as they
are, and rows that join a running batch or leave it (`BatchCache.regroup`: the kept rows, then the
joining ones, copied into new buffers, each column where it was) are never re-rotated. Buffers start
at zero: a masked column is never read as NaN.
"""
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

Fill = Callable[[int, torch.Tensor, torch.Tensor], None]


class BatchLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, index: int, rows: int, capacity: int, shape: tuple[int, int], dtype, device, fill: Fill | None):
        super().__init__()
        H, d = shape
        self.index, self.fill, self.length = index, fill, 0
        self.dtype, self.device = dtype, device
        self.k_buf = torch.zeros(rows, H, capacity, d, dtype=dtype, device=device)
        self.v_buf = torch.zeros_like(self.k_buf)
        self.is_initialized = fill is None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.fill(self.index, self.k_buf, self.v_buf)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.k_buf.shape[2]:
            raise RuntimeError(f"cache capacity {self.k_buf.shape[2]} exceeded: a row outgrew its answer budget")
        self.k_buf[:, :, self.length:self.length + n] = key_states
        self.v_buf[:, :, self.length:self.length + n] = value_states
        self.length += n
        self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.k_buf.shape[2]


class BatchCache(Cache):
    """One BatchLayer per model layer; ``length`` columns are in use, ``start`` of them are the prefix region
    that the first forward's ``fill`` writes (the model appends after it)."""

    def __init__(self, num_layers: int, rows: int, start: int, capacity: int, shape, dtype, device, fill: Fill | None):
        super().__init__(layers=[BatchLayer(l, rows, capacity, shape, dtype, device, fill) for l in range(num_layers)])
        for layer in self.layers:
            layer.length = start

    @property
    def rows(self) -> int:
        return self.layers[0].k_buf.shape[0]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def bytes(self) -> int:
        """Bytes of K/V buffers this cache holds."""
        return sum(2 * l.k_buf.numel() * l.k_buf.element_size() for l in self.layers)

    def regroup(self, keep: torch.Tensor, other: "BatchCache | None", capacity: int) -> None:
        """Keep rows ``keep`` (indices, in order), then append ``other``'s rows; every layer gets new buffers of
        ``capacity`` columns holding each kept row's first ``length`` columns (a copy: rows leave or join
        between steps, never within one)."""
        length = max(self.length, other.length if other is not None else 0)
        if capacity < length:
            raise ValueError(f"capacity {capacity} is below the {length} columns in use")
        for l, layer in enumerate(self.layers):
            # the kept rows' columns in use only: gathering whole buffers would copy their unused capacity too
            n = layer.length
            parts = [(layer.k_buf[:, :, :n].index_select(0, keep), layer.v_buf[:, :, :n].index_select(0, keep))]
            if other is not None:
                o = other.layers[l]
                parts.append((o.k_buf[:, :, :o.length], o.v_buf[:, :, :o.length]))
            rows = sum(k.shape[0] for k, _ in parts)
            H, d = layer.k_buf.shape[1], layer.k_buf.shape[3]
            k_buf = torch.zeros(rows, H, capacity, d, dtype=layer.dtype, device=layer.device)
            v_buf = torch.zeros_like(k_buf)
            at = 0
            for k, v in parts:
                k_buf[at:at + k.shape[0], :, :k.shape[2]] = k
                v_buf[at:at + k.shape[0], :, :k.shape[2]] = v
                at += k.shape[0]
            layer.k_buf, layer.v_buf, layer.length = k_buf, v_buf, length
