"""A latent layer (MLA's one unit a token, [rope key | latent]): stored as keys alone, counted against its own width,
written and read back through the real build path, and reported by `milo-store stat` (issue 62)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_store import CompressionConfig, MiloStore
from milo_store.layers import LATENT, LayerSpec, cache_values_per_token
from milo_store.layout import Layout, compressed_bytes, full_kv_bytes
from milo_store.report import describe
from milo_store.synthetic import build_synthetic_store


def latent_layout(layers: int = 2, rope: int = 4, latent: int = 12) -> Layout:
    return Layout.of([LayerSpec(LATENT, 1, rope + latent, rotary_dim=rope, latent=latent)] * layers)


def test_a_latent_layer_stores_one_unit_as_keys_and_no_values():
    layout = latent_layout()
    assert layout.present[:, 0].all() and not layout.present[:, 1].any()
    assert (layout.widths[:, 0] == 16).all() and (layout.widths[:, 1] == 0).all()
    assert full_kv_bytes(layout, np.array([10, 6])) == 16 * 2 * 16 * 2  # tokens x layers x width x fp16
    assert cache_values_per_token(layout.layers) == 2 * 16  # one unit a layer, not K and V
    assert Layout.from_record(layout.record()) == layout
    assert layout.layer_groups() == {"latent 4+12": [0, 1]}


@pytest.mark.parametrize("fields, problem", [
    (dict(kv_heads=1, head_dim=16, latent=16), "a latent of 1..head_dim-1"),
    (dict(kv_heads=2, head_dim=16, latent=12), "one unit"),
])
def test_a_latent_layer_of_no_rope_key_or_several_heads_is_refused(fields, problem):
    with pytest.raises(ValueError, match=problem):
        LayerSpec(LATENT, **fields)


@settings(max_examples=6, deadline=None)
@given(tokens=st.lists(st.integers(16, 40), min_size=2, max_size=5), ratio=st.sampled_from([0.5, 0.25]),
       seed=st.integers(0, 2**16))
def test_a_latent_store_round_trips_and_counts_its_own_bytes(tmp_path_factory, tokens, ratio, seed):
    layout = latent_layout()
    path = tmp_path_factory.mktemp("latent") / "s"
    build_synthetic_store(path, layout, tokens, CompressionConfig(ratio=ratio), seed=seed)
    with MiloStore.open(path) as store:
        assert store.layout == layout
        assert not store.ranks[:, :, 1].any()  # no value units
        counted = compressed_bytes(layout, store.ranks, store.block_tokens, store.itemsize)
        assert int(store.block_bytes(list(range(len(tokens)))).sum()) == counted["factor_bytes"]
        assert counted["full_fp16_bytes"] == sum(tokens) * 2 * 16 * 2
        groups = describe(store)["layer_groups"]
        assert [g["group"] for g in groups] == ["latent 4+12"] and groups[0]["full_fp16_bytes"] == sum(tokens) * 64
        anchor = store.anchor_kv()
        assert anchor.shape[1] == 2 and not anchor[:, 1].any()  # the anchor's unit is its keys too
        assert torch.isfinite(anchor).all()


def test_a_shared_layer_attending_a_latent_layer_is_refused():
    """A shared layer attends its source's K/V through the attention's per-head path, which a latent unit is not."""
    from milo_store.layers import SHARED, check_layers

    unit = LayerSpec(LATENT, 1, 16, rotary_dim=4, latent=12)
    with pytest.raises(ValueError, match="not an earlier attention layer"):
        check_layers((unit, LayerSpec(SHARED, 1, 16, source=0)))
