import json
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from milo_store import (CompressionConfig, FormatVersionError, Layout, MiloStore, NotAStoreError, StoreCorruptedError,
                        StoreError, StoreLockedError, StoreWriter)
from milo_store.format import FORMAT_VERSION, array_checksum
from milo_store.layout import RAW_RANK
from milo_store.synthetic import block_location, build_synthetic_store

from .conftest import LAYOUT, TOKENS, bits_store, synthetic_store
from .format3 import format3_copy


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 5), st.integers(1, 2), st.integers(1, 3), st.sampled_from([8, 16]),
       st.sampled_from(["float16", "bfloat16", "float32"]), st.sampled_from([64, 256, 1 << 20]), st.integers(0, 999))
def test_write_read_random_ragged_store_is_byte_exact(tmp_path_factory, N, L, H, d, dtype, chunk_bytes, seed):
    rng = np.random.default_rng(seed)
    layout = Layout(L, H, d)
    tokens = rng.integers(1, 30, N)
    ranks = rng.integers(RAW_RANK, d + 1, (N, L, 2, H))  # raw units among factored ones
    ranks = np.minimum(ranks, tokens.reshape(-1, 1, 1, 1))
    offsets = layout.block_offsets(ranks, tokens)
    tdtype = getattr(torch, dtype)
    blocks = [torch.randn(int(offsets[i + 1] - offsets[i])).to(tdtype) for i in range(N)]
    path = tmp_path_factory.mktemp("rt") / "s"
    with StoreWriter(path, layout, ranks, tokens, dtype=dtype, max_chunk_bytes=chunk_bytes) as w:
        for b in blocks:
            w.write_block(b)
        w.commit()
    with MiloStore.open(path, tier="disk") as store:  # whole blocks in chunks sized to them, none too large
        sizes = np.diff(offsets) * store.itemsize
        assert np.array_equal(store.placement.extents[:, 2], sizes)
        assert max(store.placement.sizes) <= max(chunk_bytes, int(sizes.max()))
        assert store.placement.dead_bytes() == 0 and sum(store.placement.sizes) == sizes.sum()
    older = format3_copy(path, path.parent / "v3", chunk_bytes)  # blocks spanning equal chunks
    for tier, location in [(t, p) for t in ("host", "disk", "cached") for p in (path, older)]:
        with MiloStore.open(location, tier=tier) as store:
            assert np.array_equal(store.ranks, ranks) and np.array_equal(store.block_tokens, tokens)
            assert store.meta["format_version"] == (FORMAT_VERSION if location == path else 3)  # raw units or not
            for i, b in enumerate(blocks):
                got = store.block(i)
                assert got.dtype == tdtype and torch.equal(got.view(torch.uint8), b.view(torch.uint8))
                assert store.block_layer_bounds(i)[-1] == b.numel()
                assert store.block_bytes([i]).tolist() == [b.numel() * b.element_size()]


def test_host_tier_block_is_a_zero_copy_view(small_store):
    with MiloStore.open(small_store, tier="host") as store:
        a, b = store.block(1), store.block(1)
        start = store.block(0).data_ptr()  # the tier's one allocation starts with block 0
        assert a.untyped_storage().data_ptr() == start
        assert a.data_ptr() == b.data_ptr() == start + int(store.offsets[1]) * store.itemsize


def test_accounting_matches_disk_within_two_percent(tmp_path):
    layout = Layout(4, 2, 32)
    path = build_synthetic_store(tmp_path / "s", layout, [120, 90, 150, 60, 170], CompressionConfig(ratio=0.5))
    with MiloStore.open(path) as store:
        acc = store.accounting()
    assert abs(acc["ratio"] - 0.5) <= 0.02 * 0.5
    # bytes the factor files take follow the allocated ranks: no padding between blocks
    assert acc["factor_file_bytes"] <= acc["factor_bytes"] * 1.02 + 4096


def test_anchor_and_examples_roundtrip(small_store):
    with MiloStore.open(small_store) as store:
        ex = store.examples()
        assert ex["block"] == list(range(len(TOKENS))) and ex["input"][2] == "synthetic demonstration 2"
        assert tuple(store.anchor_kv().shape) == (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, 4, LAYOUT.head_dim)


def test_existing_store_needs_force_and_non_store_is_never_overwritten(tmp_path, small_store):
    with pytest.raises(StoreError, match="force"):
        build_synthetic_store(small_store, LAYOUT, TOKENS)
    with MiloStore.open(small_store) as first:
        assert MiloStore.current_version(small_store) == first.version
    build_synthetic_store(small_store, LAYOUT, TOKENS[:2], force=True)
    with MiloStore.open(small_store) as replaced:
        assert replaced.num_blocks == 2
        assert MiloStore.current_version(small_store) == replaced.version != first.version
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(StoreError, match="not a milo store"):
        build_synthetic_store(other, LAYOUT, TOKENS, force=True)
    assert (other / "precious.txt").read_text() == "keep me"


def test_second_concurrent_writer_is_refused(tmp_path):
    ranks = np.ones((1, LAYOUT.num_layers, 2, LAYOUT.num_kv_heads))
    first = StoreWriter(tmp_path / "s", LAYOUT, ranks, [5])
    try:
        with pytest.raises(StoreLockedError, match="another writer"):
            StoreWriter(tmp_path / "s", LAYOUT, ranks, [5])
    finally:
        first.abort()
    StoreWriter(tmp_path / "s", LAYOUT, ranks, [5]).abort()  # free again once the first is gone


def test_the_lock_file_goes_with_the_lock_and_a_racer_on_the_removed_file_is_refused(tmp_path, monkeypatch):
    import milo_store.writer as writer

    store = build_synthetic_store(tmp_path / "s", LAYOUT, TOKENS)
    assert not (tmp_path / "s.lock").exists()  # a finished build leaves no lock file beside the store
    first = writer.StoreLock(tmp_path / "s").__enter__()
    stale = os.open(first.lock_path, os.O_RDWR)  # a writer that opened the file just before its removal
    with pytest.raises(StoreLockedError):
        writer.StoreLock(tmp_path / "s").__enter__()
    assert first.lock_path.exists()  # a refused writer removes nothing
    first.__exit__()
    assert not first.lock_path.exists()
    second = writer.StoreLock(store).__enter__()  # a new file at the path, held
    real_open, opened = os.open, []
    monkeypatch.setattr(writer.os, "open", lambda *a: stale if not opened and not opened.append(1) else real_open(*a))
    with pytest.raises(StoreLockedError):  # it wins the removed file's lock, sees it is not the path's, retries
        writer.StoreLock(store).__enter__()
    monkeypatch.undo()
    second.__exit__()
    assert not second.lock_path.exists()


# -- corruption: every case is a clear error, never wrong data ------------------------------------

@pytest.mark.parametrize("build", [synthetic_store, lambda tmp_path: bits_store(tmp_path)[0]], ids=["lowrank", "bits"])
def test_a_damaged_block_is_detected_and_named_never_decoded(tmp_path, build):
    path = build(tmp_path)
    chunk, at = block_location(path, 2)
    raw = bytearray(chunk.read_bytes())
    raw[at + 5] ^= 0x40
    chunk.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptedError, match="block 2 fails its checksum"):
        MiloStore.open(path, tier="host")
    with MiloStore.open(path, tier="disk") as store:
        store.block(1)
        with pytest.raises(StoreCorruptedError, match="block 2"):
            store.block(2)
        assert store.verify_all() == [f"{path}: block 2 fails its checksum (corrupted factor bytes)"]


def test_truncated_chunk_is_detected(small_store, tmp_path):
    for store in (small_store, format3_copy(small_store, tmp_path / "v3")):
        chunk, _ = block_location(store, 0)
        chunk.write_bytes(chunk.read_bytes()[:-7])
        with pytest.raises(StoreCorruptedError, match="truncated"):
            MiloStore.open(store, tier="disk")


def test_missing_metadata_wrong_version_and_non_store(tmp_path, small_store):
    meta = small_store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["milo"]["format_version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(FormatVersionError, match="version 99"):
        MiloStore.open(small_store)
    del doc["attributes"]["milo"]
    meta.write_text(json.dumps(doc))
    with pytest.raises(NotAStoreError, match="not a milo store"):
        MiloStore.open(small_store)
    meta.unlink()
    with pytest.raises(NotAStoreError, match="no zarr.json"):
        MiloStore.open(small_store)
    with pytest.raises(NotAStoreError, match="no such store"):
        MiloStore.open(tmp_path / "nowhere")


def test_writer_refuses_impossible_ranks(tmp_path):
    ranks = np.ones((1, LAYOUT.num_layers, 2, LAYOUT.num_kv_heads))
    for bad in (-2, LAYOUT.head_dim + 1):  # below RAW_RANK; above the head dim
        ranks[0, 0, 0, 0] = bad
        with pytest.raises(ValueError, match=r"ranks must be -1 \(raw\) or in \[0, head_dim="):
            StoreWriter(tmp_path / "s", LAYOUT, ranks, [5])


@pytest.mark.parametrize("bad", [RAW_RANK - 1, LAYOUT.head_dim + 1])
def test_a_rank_out_of_range_in_the_index_is_corruption(tmp_path, bad):
    """The reader holds the index to the writer's rule (Layout.ranks_in_range) before laying out a byte."""
    import zarr

    ranks = np.ones((1, LAYOUT.num_layers, 2, LAYOUT.num_kv_heads))
    with StoreWriter(tmp_path / "s", LAYOUT, ranks, [5]) as w:
        w.write_block(torch.zeros(int(LAYOUT.block_offsets(ranks, np.array([5]))[-1]), dtype=torch.float16))
        w.commit()
    stored = zarr.open_array(str(tmp_path / "s" / "ranks"), mode="r+")
    stored[0, 0, 0, 0] = bad
    meta = tmp_path / "s" / "zarr.json"  # re-record the checksum: the range rule must stop it on its own
    doc = json.loads(meta.read_text())
    doc["attributes"]["milo"]["array_checksums"]["ranks"] = array_checksum(stored[...])
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreCorruptedError, match="impossible token counts or ranks"):
        MiloStore.open(tmp_path / "s")


def test_raw_units_in_a_version_1_store_are_corruption(tmp_path):
    """A reader must never take the raw sentinel from a store that claims the format before it."""
    ranks = np.full((1, LAYOUT.num_layers, 2, LAYOUT.num_kv_heads), RAW_RANK)
    with StoreWriter(tmp_path / "s4", LAYOUT, ranks, [5]) as w:
        w.write_block(torch.zeros(int(LAYOUT.block_offsets(ranks, np.array([5]))[-1]), dtype=torch.float16))
        w.commit()
    meta = format3_copy(tmp_path / "s4", tmp_path / "s") / "zarr.json"
    doc = json.loads(meta.read_text())
    assert doc["attributes"]["milo"]["format_version"] == 3
    doc["attributes"]["milo"]["format_version"] = 1
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreCorruptedError, match="cannot hold raw units"), pytest.warns(UserWarning, match="unchecked"):
        MiloStore.open(tmp_path / "s")


def test_missing_index_array_is_corruption(small_store):
    shutil.rmtree(small_store / "ranks")
    with pytest.raises(StoreCorruptedError):
        MiloStore.open(small_store)


def test_replace_killed_between_renames_is_recovered(tmp_path, small_store):
    """A forced replace renames the old store aside, then the new one in: a kill in between leaves
    only <path>.old-*, which the next writer puts back (the path is then a store again)."""
    old = small_store.parent / (small_store.name + ".old-99999")
    small_store.rename(old)
    with pytest.raises(StoreError, match="force"):  # restored first, so it is not silently overwritten
        build_synthetic_store(small_store, LAYOUT, TOKENS)
    assert MiloStore.open(small_store).num_blocks == len(TOKENS) and not old.exists()


def test_failed_mount_releases_its_file_descriptors(small_store):
    import os
    chunk, at = block_location(small_store, 0)
    raw = bytearray(chunk.read_bytes())
    raw[at + 3] ^= 1
    chunk.write_bytes(bytes(raw))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(StoreCorruptedError):
            MiloStore.open(small_store, tier="host")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_store_before_array_checksums_reads_with_a_warning(small_store, tmp_path):
    """Version 2 recorded no checksums of its metadata arrays: still readable, and says they are unchecked."""
    small_store = format3_copy(small_store, tmp_path / "v3")
    meta = small_store / "zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["milo"]["array_checksums"]
    doc["attributes"]["milo"]["format_version"] = 2
    meta.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="read unchecked"), MiloStore.open(small_store, tier="disk") as store:
        assert store.examples()["input"][0] == "synthetic demonstration 0" and store.verify_all() == []
    doc["attributes"]["milo"]["format_version"] = 3  # a store of format 3 or later must record them
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreCorruptedError, match="lack the checksums of its arrays"):
        MiloStore.open(small_store)
