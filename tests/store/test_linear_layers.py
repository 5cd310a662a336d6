"""A linear layer (Gated DeltaNet's state, issue 61): no K/V units but a fixed-size state section at its layer's place in
every block, (M, C, conv tail), in the factor dtype (float16 bytes in a quantized store); the anchor's state beside
the anchor in fp32. Written and read back through the real build path, counted, verified, reported and pushed."""
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_store import CompressionConfig, MiloStore, StoreWriter
from milo_store import format as fmt
from milo_store import synthetic
from milo_store.layers import ATTENTION, LINEAR, LayerSpec, cache_values_per_token, grid
from milo_store.layout import Layout, compressed_bytes, full_kv_bytes
from milo_store.push import push
from milo_store.report import describe

ATTENTION_LAYER = LayerSpec(ATTENTION, 2, 8)


def linear(heads=3, key_dim=4, value_dim=5, conv_dim=7, kernel=4, rule="gated_delta") -> LayerSpec:
    if rule == "conv":  # a short convolution: its conv tail alone
        return LayerSpec(LINEAR, conv_dim=conv_dim, conv_kernel=kernel, rule=rule)
    return LayerSpec(LINEAR, heads, key_dim, value_dim=value_dim, conv_dim=conv_dim, conv_kernel=kernel, rule=rule)


def test_a_linear_layer_stores_no_units_but_a_section_of_fixed_size():
    layout = Layout.of([linear(), ATTENTION_LAYER, linear()])
    per_layer = 3 * 4 * (4 + 5) + 3 * 7  # M and C per head, then the conv tail's kernel - 1 inputs
    assert linear().state_values == per_layer
    assert not layout.present[[0, 2]].any() and layout.present[1].all()
    assert grid(layout.layers) == (2, 8)  # the grid is the attention layers'
    assert layout.state_sizes.tolist() == [per_layer, 0, per_layer]
    assert Layout.of(layout.layers, "int4").state_sizes.tolist() == [2 * per_layer, 0, 2 * per_layer]  # fp16 bytes
    assert full_kv_bytes(layout, np.array([10])) == 10 * 2 * 2 * 8 * 2  # the attention layer's K and V only
    assert cache_values_per_token(layout.layers) == 2 * 2 * 8
    assert layout.layer_groups() == {"linear 3x4x5": [0, 2], "kv 2x8": [1]}
    assert Layout.from_record(layout.record()) == layout
    mamba = Layout.of([linear(rule="mamba2"), ATTENTION_LAYER])  # M a scalar a head
    assert mamba.state_sizes[0] == 3 + 3 * 4 * 5 + 3 * 7 and mamba.layer_groups()["mamba2 3x4x5"] == [0]
    parts = mamba.state_section(0, torch.arange(float(mamba.state_sizes[0])))
    assert parts["M"].shape == (3,) and parts["C"].shape == (3, 4, 5) and parts["conv"][0, 0] == 3 + 60
    assert Layout.from_record(mamba.record()) == mamba
    ranks = np.ones((2, 3, 2, 2), dtype=np.int16)
    ranks[:, [0, 2]] = 0
    offsets = layout.block_offsets(ranks, np.array([6, 9]))
    bounds = layout.layer_offsets(ranks[1], 9)
    assert bounds[1] == per_layer and bounds[3] - bounds[2] == per_layer
    assert offsets[2] - offsets[1] == bounds[-1]


@pytest.mark.parametrize("fields, problem", [
    (dict(kv_heads=3, head_dim=4, value_dim=0, conv_dim=7, conv_kernel=4), "at least 1"),
    (dict(kv_heads=3, head_dim=4, value_dim=5, conv_dim=7, conv_kernel=0), "at least 1"),
    (dict(kv_heads=3, head_dim=4, value_dim=5, conv_dim=7, conv_kernel=4, rule="conv"), "conv tail alone"),
])
def test_a_linear_layer_without_its_state_or_convolution_shapes_is_refused(fields, problem):
    with pytest.raises(ValueError, match=problem):
        LayerSpec(LINEAR, **fields)


def drawn_states():
    """`synthetic.synthetic_states` as the build draws them, each call's result kept (the blocks', then the anchor's)."""
    drawn = []

    def draw(layout, generator):
        drawn.append(real(layout, generator))
        return drawn[-1]

    real = synthetic.synthetic_states
    return drawn, mock.patch.object(synthetic, "synthetic_states", draw)


@settings(max_examples=8, deadline=None)
@given(pattern=st.lists(st.sampled_from([None, "gated_delta", "mamba2", "conv"]), min_size=1, max_size=4),
       tokens=st.lists(st.integers(20, 48), min_size=1, max_size=4),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8", "int4"]), seed=st.integers(0, 2**16))
def test_a_hybrid_store_keeps_each_blocks_states_and_the_anchors(tmp_path_factory, pattern, tokens, dtype, seed):
    layers = [linear(rule=rule) if rule else ATTENTION_LAYER for rule in pattern] + [ATTENTION_LAYER]
    path = tmp_path_factory.mktemp("linear") / "s"
    drawn, patched = drawn_states()
    with patched:
        synthetic.build_synthetic_store(path, Layout.of(layers), tokens, CompressionConfig(dtype=dtype), seed=seed)
    stored_as = torch.float16 if dtype in fmt.QUANTIZED else fmt.TORCH_DTYPES[dtype]
    with MiloStore.open(path) as store:
        assert store.layout.layers == tuple(layers) and store.verify_all() == []
        for i, block in enumerate(store.stored_blocks(list(range(len(tokens))))):
            states = store.layout.block_states(store.ranks[i], int(store.block_tokens[i]), block)
            assert sorted(states) == sorted(drawn[i])
            for l, section in states.items():
                got = torch.cat([section[k].reshape(-1) for k in ("M", "C", "conv")]).float()
                assert torch.equal(got, drawn[i][l].to(stored_as).float())
        anchor = store.anchor_states() or {}
        assert sorted(anchor) == sorted(drawn[-1]) and all(torch.equal(anchor[l], drawn[-1][l]) for l in anchor)
        counted = compressed_bytes(store.layout, store.ranks, store.block_tokens, store.itemsize)
        assert counted["state_bytes"] == len(tokens) * sum(spec.state_values for spec in layers) * (
            2 if dtype in fmt.QUANTIZED else store.itemsize)
        assert int(store.block_bytes(list(range(len(tokens)))).sum()) == counted["factor_bytes"] + counted["state_bytes"]
        report = describe(store)
        assert report["bytes"]["states"] == counted["state_bytes"]
        linear_groups = [g for g in report["layer_groups"] if g["group"].startswith(("linear", "mamba2", "conv"))]
        assert sum(g["factor_bytes"] for g in linear_groups) == counted["state_bytes"]
        assert all(g["full_fp16_bytes"] == 0 for g in linear_groups)


def test_a_damaged_state_section_is_found_by_its_blocks_checksum(tmp_path):
    path = tmp_path / "s"
    synthetic.build_synthetic_store(path, Layout.of([ATTENTION_LAYER, linear()]), [24, 30])
    with MiloStore.open(path, tier="disk") as store:
        chunk, offset, length = (int(x) for x in store.placement.extents[1])
        name = store.placement.names[chunk]
    with open(path / name, "r+b") as f:  # the block's last bytes: its last layer's state section
        f.seek(offset + length - 1)
        byte = f.read(1)
        f.seek(offset + length - 1)
        f.write(bytes([byte[0] ^ 0x40]))
    with MiloStore.open(path, tier="disk") as store:
        problems = store.verify_all()
    assert len(problems) == 1 and "block 1" in problems[0]


def test_a_hybrid_store_without_its_anchor_state_is_not_committed(tmp_path):
    layout = Layout.of([ATTENTION_LAYER, linear()])
    with StoreWriter(tmp_path / "s", layout, np.ones((1, 2, 2, 2), dtype=np.int16) * [[[[1]], [[0]]]],
                     np.array([12])) as w:
        with pytest.raises(ValueError, match="anchor state"):
            w.write_anchor(torch.zeros(2, 2, 2, 3, 8))
        w.abort()


def test_a_pushed_hybrid_store_keeps_its_states(tmp_path):
    path = tmp_path / "s"
    synthetic.build_synthetic_store(path, Layout.of([linear(), ATTENTION_LAYER]), [24, 30])
    url = push(path, "memory://milo-test-linear-push")
    with MiloStore.open(path) as local, MiloStore.open(url) as remote:
        assert torch.equal(remote.anchor_states()[0], local.anchor_states()[0])
        assert all(torch.equal(a, b) for a, b in zip(remote.stored_blocks([0, 1]), local.stored_blocks([0, 1])))
