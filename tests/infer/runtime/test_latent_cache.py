"""The paged cache of an MLA layer (`PagedLayer` of a latent `LayerSpec`): one pool of units, no values."""
import pytest
import torch

from milo_infer.runtime.cache import Pack, PagedCache
from milo_store.layers import LATENT, LayerSpec

UNIT = LayerSpec(LATENT, 1, 16, rotary_dim=4, latent=12)


def cache_with_a_pack(columns: torch.Tensor) -> PagedCache:
    cache = PagedCache([UNIT], torch.float32, torch.device("cpu"), {False: 1})
    cache.pack = Pack(segments=[], columns=columns)
    return cache


def test_a_latent_layer_keeps_rope_key_then_latent_and_hands_back_one_token():
    cache = cache_with_a_pack(torch.tensor([3, 4]))
    latent, rope = torch.randn(1, 1, 2, 12), torch.randn(1, 1, 2, 4)
    k, v = cache.layers[0].update(latent, rope, 0)
    pool = cache.layers[0].k_pool
    assert cache.layers[0].v_pool.shape[-1] == 0 and k.shape[2] == v.shape[2] == 1
    torch.testing.assert_close(pool[0, 3:5], torch.cat((rope[0, 0], latent[0, 0]), -1), rtol=0, atol=0)
    assert cache.pack.latent[0] is pool


def test_expanded_keys_and_values_handed_to_a_latent_layer_are_refused_naming_why():
    cache = cache_with_a_pack(torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="per-head keys and values, not its latent"):
        cache.layers[0].update(torch.randn(1, 4, 2, 12), torch.randn(1, 4, 2, 4), 0)
