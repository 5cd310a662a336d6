"""A transformers cache whose prefix (anchor + retrieved blocks) is rebuilt from the store, layer by layer.

gpt-fast style: each layer owns preallocated K/V buffers [1, H, capacity, d] and one ``update``. The
first ``update`` of a layer fills rows [0, prefix) by calling ``fill(layer)`` (reconstruction through
``milo_kernels.reconstruct_layer``), so the prefix of layer l+1 is rebuilt only when the model gets
there, while the prefetcher already moves its factors. The prefix length is known up front, so
positions and masks are right before any layer is filled.
"""
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class MiloLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, index: int, prefix_len: int, capacity: int, shape: tuple[int, int], dtype, device,
                 fill: Callable[[int, torch.Tensor, torch.Tensor], None]):
        super().__init__()
        self.index, self.prefix_len, self.length = index, prefix_len, prefix_len
        self.capacity, self.shape, self.dtype, self.device, self.fill = capacity, shape, dtype, device, fill

    def lazy_initialization(self, key_states, value_states) -> None:
        H, d = self.shape
        self.k_buf = torch.empty(1, H, self.capacity, d, dtype=self.dtype, device=self.device)
        self.v_buf = torch.empty_like(self.k_buf)
        self.fill(self.index, self.k_buf[0, :, :self.prefix_len], self.v_buf[0, :, :self.prefix_len])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            raise RuntimeError(f"cache capacity {self.capacity} exceeded: grow max_new_tokens or the query budget")
        self.k_buf[:, :, self.length:self.length + n] = key_states
        self.v_buf[:, :, self.length:self.length + n] = value_states
        self.length += n
        self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity


class MiloCache(Cache):
    """One MiloLayer per model layer, sharing the prefix length and the fill callback."""

    def __init__(self, num_layers: int, prefix_len: int, capacity: int, shape, dtype, device, fill):
        super().__init__(layers=[MiloLayer(l, prefix_len, capacity, shape, dtype, device, fill)
                                 for l in range(num_layers)])
