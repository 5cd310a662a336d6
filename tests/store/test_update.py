"""Store updates (`write_store` with ``previous``): kept blocks byte for byte, shared chunks linked or copied
server-side, the base version checked, a lost race leaving nothing, gc of the previous version, and
`milo-store verify --absent`."""
import os
import shutil

import numpy as np
import obstore
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import milo_store.format as fmt
import milo_store.remote
from milo_store import CompressionConfig, MiloStore
from milo_store.blockcache import BlockCache
from milo_store.cli.main import main as store_cli
from milo_store.errors import LostRaceError, StoreLockedError
from milo_store.remote import RemoteTarget, gc
from milo_store.synthetic import build_synthetic_store, update_synthetic_store
from milo_store.writer import StoreLock, StoreWriter

from .conftest import LAYOUT, TOKENS
from .test_remote import _manifest, _versions

CONFIG = CompressionConfig(ratio=0.5)


def blocks_of(path, **open_args) -> list[torch.Tensor]:
    with MiloStore.open(path, tier="disk", **open_args) as s:
        assert s.verify_all() == []
        return [s.block(i).clone() for i in range(s.num_blocks)]


def shared_chunks(keep: list[int], old_offsets: np.ndarray, chunk: int) -> int:
    """Chunks an update keeping ``keep`` shares: those wholly before the first block that moves."""
    leading = next((i for i, b in enumerate(keep) if b != i), len(keep))
    return int(old_offsets[leading]) // chunk


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.integers(10, 40), min_size=1, max_size=6), data=st.data(),
       new=st.lists(st.integers(10, 40), max_size=3), chunk_bytes=st.sampled_from([300, 2048, 1 << 20]),
       dtype=st.sampled_from(["float16", "int8"]))
def test_an_update_keeps_every_kept_block_byte_for_byte(tmp_path_factory, monkeypatch, tokens, data, new,
                                                        chunk_bytes, dtype):
    """Any kept subset in any order, any new blocks, any chunk size: kept blocks are the previous bytes, the
    leading unchanged chunks are the previous version's files (hard links), and the store verifies."""
    keep = data.draw(st.lists(st.sampled_from(range(len(tokens))), unique=True, max_size=len(tokens)))
    if not keep and not new:
        keep = [0]
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", chunk_bytes)
    path = tmp_path_factory.mktemp("update") / "store"
    config = CompressionConfig(ratio=0.5, dtype=dtype)
    build_synthetic_store(path, LAYOUT, tokens, config, seed=1)
    old = blocks_of(path)
    with MiloStore.open(path, tier="disk") as s:
        offsets, chunk, ids = s.offsets.copy(), s.chunk, s.examples()["id"]
    inodes = {c: os.stat(fmt.factor_chunk_path(path, c)).st_ino for c in range(shared_chunks(keep, offsets, chunk))}
    update_synthetic_store(path, keep, new, config, seed=2)
    got = blocks_of(path)
    assert len(got) == len(keep) + len(new)
    assert all(torch.equal(got[i], old[b]) for i, b in enumerate(keep))
    assert {c: os.stat(fmt.factor_chunk_path(path, c)).st_ino for c in inodes} == inodes
    with MiloStore.open(path) as s:
        assert s.chunk == chunk and s.examples()["id"][:len(keep)] == [ids[b] for b in keep]
    assert not list(path.parent.glob("store.tmp-*")) and not list(path.parent.glob("store.old-*"))


def test_an_update_of_a_url_copies_its_unchanged_chunks_server_side(tmp_path, s3_url, monkeypatch):
    monkeypatch.setattr(milo_store.writer, "REMOTE_CHUNK_BYTES", 1024)
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    first = _manifest(s3_url)["version"]
    old = blocks_of(s3_url)
    with MiloStore.open(s3_url, tier="disk") as s:
        shared = shared_chunks([0, 1, 2], s.offsets, s.chunk)
        pinned = MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "pinned"))
    assert shared >= 2
    puts, copies = [], []
    real_put, real_copy = obstore.put, obstore.copy
    monkeypatch.setattr(milo_store.remote.obstore, "put", lambda st_, p, *a, **k: puts.append(p) or real_put(st_, p, *a, **k))
    monkeypatch.setattr(milo_store.remote.obstore, "copy", lambda st_, a, b, **k: copies.append(b) or real_copy(st_, a, b, **k))
    update_synthetic_store(s3_url, [0, 1, 2], [17], CONFIG, seed=2)  # block 3 out, a new one in
    m = _manifest(s3_url)
    assert m["previous"] == first
    assert sorted(copies) == sorted(f"v/{m['version']}/factors/c/{c}" for c in range(shared))
    assert not any(p.startswith(f"v/{m['version']}/factors/c/") and p in copies for p in puts)
    got = blocks_of(s3_url)
    assert all(torch.equal(got[i], old[i]) for i in range(3)) and len(got) == 4
    with pinned:  # a mount of the previous version keeps reading it
        assert pinned.num_blocks == 4 and all(torch.equal(pinned.block(i), old[i]) for i in range(4))


def test_an_update_refuses_a_store_that_changed_since_it_was_read(tmp_path, s3_url, monkeypatch):
    """An update based on a version the manifest no longer names writes nothing (local: the attributes changed)."""
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    for location in (s3_url, tmp_path / "local"):
        build_synthetic_store(location, LAYOUT, TOKENS, CONFIG, seed=1)
        stale = MiloStore.open(location, tier="disk", block_cache=BlockCache(tmp_path / "c"))
        update_synthetic_store(location, [0, 1], [20], CONFIG, seed=2)  # another writer, first
        before = blocks_of(location)
        with stale, pytest.raises(LostRaceError, match="changed since it was read"):
            StoreWriter(location, stale.layout, stale.ranks, stale.block_tokens, dtype=stale.dtype, previous=stale)
        assert [torch.equal(a, b) for a, b in zip(before, blocks_of(location))] == [True] * 3
    assert len(_versions(s3_url)) == 2


def test_a_writer_that_loses_the_manifest_race_removes_its_version(tmp_path, s3_url):
    local = build_synthetic_store(tmp_path / "local", LAYOUT, TOKENS, CONFIG, seed=1)
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    targets = [RemoteTarget(s3_url, force=True) for _ in range(2)]  # both saw the same manifest
    targets[0].publish(local, fmt.FORMAT_VERSION)
    with pytest.raises(LostRaceError, match="lost the race and removed the version it had uploaded"):
        targets[1].publish(local, fmt.FORMAT_VERSION)
    assert len(_versions(s3_url)) == 2  # the first build's and the winner's: nothing of the loser's


def test_a_second_update_while_one_runs_is_refused_and_leaves_nothing(tmp_path):
    path = build_synthetic_store(tmp_path / "store", LAYOUT, TOKENS, CONFIG, seed=1)
    before = sorted(p.name for p in tmp_path.iterdir())
    with StoreLock(path):  # an update in progress holds the writer lock
        with pytest.raises(StoreLockedError, match="another writer"):
            update_synthetic_store(path, [0, 1], [12], CONFIG, seed=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert len(blocks_of(path)) == len(TOKENS)


def test_gc_only_current_removes_the_previous_version(tmp_path, s3_url, monkeypatch, capsys):
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    update_synthetic_store(s3_url, [0, 1, 3], [], CONFIG, seed=2)  # removes block 2 and its demonstration '2'
    m = _manifest(s3_url)
    assert gc(s3_url, older_than=0)["removed_versions"] == []  # the previous version is kept by default
    assert store_cli(["verify", s3_url, "--absent", "2"]) == 1
    out = capsys.readouterr().out
    assert f"version {m['previous']} still holds demonstration(s) '2'" in out and "--only-current" in out
    assert store_cli(["gc", s3_url, "--only-current", "--older-than", "0"]) == 0
    capsys.readouterr()
    assert _versions(s3_url) == [m["version"]]
    assert store_cli(["verify", s3_url, "--absent", "2"]) == 0
    assert "1 demonstration(s) absent" in capsys.readouterr().out


def test_verify_absent_on_a_directory(tmp_path, capsys):
    path = build_synthetic_store(tmp_path / "store", LAYOUT, TOKENS, CONFIG, seed=1)
    old_index = tmp_path / "old-index"
    shutil.copytree(path / fmt.INDEXES, old_index)
    update_synthetic_store(path, [0, 1, 3], [], CONFIG, seed=2)
    assert store_cli(["verify", str(path), "--absent", "2,1"]) == 1
    assert f"demonstration '1' is in the store (block 1)" in capsys.readouterr().out
    assert store_cli(["verify", str(path), "--absent", "2", "--json"]) == 0
    capsys.readouterr()

    shutil.copytree(old_index, tmp_path / "store.old-99")  # what a writer killed between its two renames leaves
    stray = path / fmt.EXAMPLES / "input" / "c" / "7"
    stray.write_bytes(b"removed text")
    assert store_cli(["verify", str(path), "--absent", "2"]) == 1
    out = capsys.readouterr().out
    assert "store.old-99: a writer's leftover" in out and "examples/input/c/7 is not a file of the store's arrays" in out
    stray.unlink()
    shutil.rmtree(tmp_path / "store.old-99")

    shutil.rmtree(path / fmt.INDEXES)  # the index of the version before the update, whole and self-consistent
    shutil.copytree(old_index, path / fmt.INDEXES)
    assert store_cli(["verify", str(path), "--absent", "2"]) == 1
    assert "index bm25 is not the index of the store's demonstrations" in capsys.readouterr().out
