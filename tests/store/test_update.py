"""Store updates (`write_store` with ``previous``): kept blocks byte for byte in the chunks they were in (linked,
or referenced at a URL), dead bytes reported and compacted, the base version checked, a lost race leaving
nothing, gc of the previous version, and `milo-store verify --absent`."""
import json
import os
import shutil

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
from milo_store.remote import RemoteTarget, gc, version_chunks
from milo_store.synthetic import build_synthetic_store, update_synthetic_store
from milo_store.urls import open_object_store
from milo_store.writer import StoreLock, StoreWriter

from .conftest import LAYOUT, TOKENS
from .test_remote import _manifest, _versions

CONFIG = CompressionConfig(ratio=0.5)


def blocks_of(path, **open_args) -> list[torch.Tensor]:
    with MiloStore.open(path, tier="disk", **open_args) as s:
        assert s.verify_all() == []
        return [s.block(i).clone() for i in range(s.num_blocks)]


def chunk_of(store: MiloStore, block: int) -> str:
    return store.placement.ids[int(store.placement.extents[block, 0])]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.integers(10, 40), min_size=1, max_size=6), data=st.data(),
       new=st.lists(st.integers(10, 40), max_size=3), chunk_bytes=st.sampled_from([300, 2048, 1 << 20]),
       dtype=st.sampled_from(["float16", "int8"]), purge_all=st.booleans())
def test_an_update_keeps_every_kept_block_byte_for_byte(tmp_path_factory, monkeypatch, tokens, data, new,
                                                        chunk_bytes, dtype, purge_all):
    """Any kept subset in any order, any new blocks, any chunk size: kept blocks are the previous bytes, in the
    previous version's chunk files (hard links, the same block identity) unless their chunk held a purged block,
    new ones in new chunks; what the version does not use of its chunks is its dead bytes; the store verifies."""
    keep = data.draw(st.lists(st.sampled_from(range(len(tokens))), unique=True, max_size=len(tokens)))
    if not keep and not new:
        keep = [0]
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", chunk_bytes)
    path = tmp_path_factory.mktemp("update") / "store"
    config = CompressionConfig(ratio=0.5, dtype=dtype)
    build_synthetic_store(path, LAYOUT, tokens, config, seed=1)
    old = blocks_of(path)
    with MiloStore.open(path, tier="disk") as s:
        ids, keys = s.examples()["id"], [s.block_key(b) for b in range(s.num_blocks)]
        chunks = [chunk_of(s, b) for b in range(s.num_blocks)]
        inodes = {c: os.stat(path / fmt.chunk_key(c)).st_ino for c in set(chunks)}
    purge = set(range(len(tokens))) - set(keep) if purge_all else set()
    dropped = {chunks[b] for b in purge}
    update_synthetic_store(path, keep, new, config, seed=2, purge=purge)
    got = blocks_of(path)
    assert len(got) == len(keep) + len(new)
    assert all(torch.equal(got[i], old[b]) for i, b in enumerate(keep))
    with MiloStore.open(path) as s:
        for i, b in enumerate(keep):
            stays = chunks[b] not in dropped
            assert (s.block_key(i) == keys[b]) == stays
            assert (os.stat(path / fmt.chunk_key(chunk_of(s, i))).st_ino == inodes.get(chunk_of(s, i))) == stays
        assert all(chunk_of(s, i) not in inodes for i in range(len(keep), s.num_blocks))  # new blocks, new chunks
        used = {chunk_of(s, i) for i in range(s.num_blocks)}
        unused = sum(old[b].numel() * old[b].element_size() for b in range(len(tokens)) if b not in keep and chunks[b] in used)
        assert s.accounting()["dead_bytes"] == unused and (not purge_all or unused == 0)
        assert s.examples()["id"][:len(keep)] == [ids[b] for b in keep]
        assert sorted(p.name for p in (path / fmt.CHUNKS).iterdir()) == sorted(set(s.placement.ids))
    assert not list(path.parent.glob("store.tmp-*")) and not list(path.parent.glob("store.old-*"))


def test_an_update_of_a_url_uploads_only_what_it_writes(tmp_path, s3_url, monkeypatch):
    """Kept blocks stay in the chunk objects the previous version references: nothing of them is uploaded or
    copied; the new version names them, and a mount of the previous version keeps reading it."""
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", 1024)  # a chunk per block
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    first = _manifest(s3_url)["version"]
    old = blocks_of(s3_url)
    with MiloStore.open(s3_url, tier="disk") as s:
        kept_chunks = {chunk_of(s, b) for b in range(3)}
        pinned = MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "pinned"))
    puts, copies = [], []
    real_put = obstore.put
    monkeypatch.setattr(milo_store.remote.obstore, "put", lambda st_, p, *a, **k: puts.append(p) or real_put(st_, p, *a, **k))
    monkeypatch.setattr(milo_store.remote.obstore, "copy", lambda *a, **k: copies.append(a))
    update_synthetic_store(s3_url, [0, 1, 2], [17], CONFIG, seed=2)  # block 3 out, a new one in
    m = _manifest(s3_url)
    assert m["previous"] == first and copies == []
    chunk_puts = {p.removeprefix("chunks/") for p in puts if p.startswith("chunks/")}
    assert chunk_puts and not chunk_puts & kept_chunks
    assert all(p.startswith(("chunks/", f"v/{m['version']}/")) or p == "manifest.json" for p in puts)
    got = blocks_of(s3_url)
    assert all(torch.equal(got[i], old[i]) for i in range(3)) and len(got) == 4
    with MiloStore.open(s3_url, tier="disk") as s:
        assert {chunk_of(s, b) for b in range(3)} == kept_chunks and chunk_of(s, 3) in chunk_puts
    with pinned:  # a mount of the previous version keeps reading it
        assert pinned.num_blocks == 4 and all(torch.equal(pinned.block(i), old[i]) for i in range(4))


def test_dead_bytes_are_reported_and_compacted(tmp_path, s3_url, monkeypatch, capsys):
    """An update that replaces a block without purging it (an append fills the last block) leaves its old
    bytes dead in a chunk it keeps; stat reports them, gc compacts them above the threshold (a new version,
    the same blocks), and at a URL the old chunk goes once the compacted version is no longer kept."""
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", 1 << 20)  # one chunk: every block kept in it
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    for location in (tmp_path / "local", s3_url):
        build_synthetic_store(location, LAYOUT, TOKENS, CONFIG, seed=1)
        update_synthetic_store(location, [0, 1, 2], [33], CONFIG, seed=2, purge=set())  # block 3 replaced, kept dead
        with MiloStore.open(location, tier="disk") as s:
            dead = s.accounting()["dead_bytes"]
            before = [s.block(i).clone() for i in range(s.num_blocks)]
            assert dead > 0 and s.verify_all() == []
        assert store_cli(["stat", str(location), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["bytes"]["dead"] == dead
        assert store_cli(["gc", str(location), "--older-than", "0", "--compact-above", "0.99", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["compaction"]["compacted"] is False  # under the threshold
        assert store_cli(["gc", str(location), "--older-than", "0", "--compact-above", "0.05", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)["compaction"]
        assert report["compacted"] and report["reclaimed_bytes"] == dead and report["blocks_rewritten"] == 3
        with MiloStore.open(location, tier="disk") as s:
            assert s.accounting()["dead_bytes"] == 0 and s.verify_all() == []
            assert all(torch.equal(s.block(i), b) for i, b in enumerate(before))
    store = open_object_store(s3_url)
    chunks = lambda: {o["path"] for batch in obstore.list(store, prefix="chunks/") for o in batch}  # noqa: E731
    before_gc = chunks()
    assert store_cli(["gc", s3_url, "--only-current", "--older-than", "0", "--json"]) == 0
    capsys.readouterr()
    referenced = {f"chunks/{c}" for c in version_chunks(store, s3_url, _manifest(s3_url)["version"])}
    assert chunks() == referenced < before_gc  # the dirty chunk went with the version before compaction


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
    local = [build_synthetic_store(tmp_path / f"local{k}", LAYOUT, TOKENS, CONFIG, seed=1) for k in range(2)]
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    store = open_object_store(s3_url)
    chunks = lambda: {o["path"] for batch in obstore.list(store, prefix="chunks/") for o in batch}  # noqa: E731
    targets = [RemoteTarget(s3_url, force=True) for _ in range(2)]  # both saw the same manifest
    targets[0].publish(local[0], fmt.FORMAT_VERSION)
    before = chunks()
    with pytest.raises(LostRaceError, match="lost the race and removed the version it had uploaded"):
        targets[1].publish(local[1], fmt.FORMAT_VERSION)
    assert len(_versions(s3_url)) == 2 and chunks() == before  # the first build's and the winner's: nothing of the loser's
    with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as s:
        assert s.verify_all() == []


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
    stray = path / fmt.CHUNKS / "0123456789abcdef"  # a chunk no version references
    stray.write_bytes(b"removed text")
    assert store_cli(["verify", str(path), "--absent", "2"]) == 1
    out = capsys.readouterr().out
    assert "store.old-99: a writer's leftover" in out and "chunks/0123456789abcdef is not a file of the store's" in out
    stray.unlink()
    shutil.rmtree(tmp_path / "store.old-99")

    shutil.rmtree(path / fmt.INDEXES)  # the vocabulary of the version before the update, whole and self-consistent
    shutil.copytree(old_index, path / fmt.INDEXES)
    assert store_cli(["verify", str(path), "--absent", "2"]) == 1
    assert "vocabulary is not the one of the store's demonstrations" in capsys.readouterr().out


def test_a_purge_leaves_no_byte_of_the_purged_blocks_in_the_version(tmp_path, monkeypatch):
    """A purged block's chunk is not referenced (its other blocks are written again), nor is a chunk holding
    dead bytes once anything is purged (they may be an earlier encoding of a purged block): no byte of the
    purged block's K/V, nor of the dead ones, is in any file of the new version."""
    tokens = [20, 21, 22, 23, 24, 25]
    path = tmp_path / "store"
    build_synthetic_store(path, LAYOUT, tokens, CONFIG, seed=1)
    with MiloStore.open(path, tier="disk") as s:
        sizes = s.block_bytes(range(s.num_blocks))
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", int(max(sizes[0::2] + sizes[1::2])))  # two blocks a chunk
    build_synthetic_store(path, LAYOUT, tokens, CONFIG, seed=1, force=True)
    with MiloStore.open(path, tier="disk") as s:
        assert [chunk_of(s, b) for b in range(6)] == [chunk_of(s, b - b % 2) for b in range(6)] and len(s.placement.ids) > 3
    update_synthetic_store(path, [0, 1, 2, 3, 4], [26], CONFIG, seed=2, purge=set())  # block 5's bytes stay, dead
    old = blocks_of(path)
    with MiloStore.open(path, tier="disk") as s:
        keys = [s.block_key(b) for b in range(s.num_blocks)]
        assert s.accounting()["dead_bytes"] == int(sizes[5]) and len({chunk_of(s, b) for b in (0, 2, 4)}) == 3
    dead = bytes(open(path / fmt.chunk_key(keys[4][1]), "rb").read()[keys[4][2] + keys[4][3]:])
    update_synthetic_store(path, [0, 1, 3, 4, 5], [], CONFIG, seed=3, purge={2})  # block 2 must leave
    with MiloStore.open(path, tier="disk") as s:
        assert s.verify_all() == [] and s.accounting()["dead_bytes"] == 0
        got = [s.block(i).clone() for i in range(s.num_blocks)]
        assert all(torch.equal(g, old[b]) for g, b in zip(got, [0, 1, 3, 4, 5]))
        assert [s.block_key(i) == keys[b] for i, b in enumerate([0, 1, 3, 4, 5])] == [True, True, False, False, True]
    files = b"".join(f.read_bytes() for f in path.rglob("*") if f.is_file())
    purged = old[2].view(torch.uint8).numpy().tobytes()
    assert purged not in files and dead not in files and len(dead) == sizes[5]


def test_gc_never_removes_a_chunk_a_kept_version_references(tmp_path, s3_url, monkeypatch, capsys):
    """gc keeps every chunk the current and previous versions reference, so mounts of either read on; a version
    two updates old goes with the chunks only it referenced; a chunk no version references is what
    `verify --absent` names and gc collects."""
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", 1)  # a chunk per block
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    store = open_object_store(s3_url)
    first = MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c1", 0))
    want_first = [first.block(i).clone() for i in range(first.num_blocks)]
    update_synthetic_store(s3_url, [0, 1, 3], [30], CONFIG, seed=2)
    second = MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c2", 0))
    assert gc(s3_url, older_than=0)["removed_chunks"] == 0
    with first:  # the previous version: every chunk of it is kept
        assert all(torch.equal(first.block(i), b) for i, b in enumerate(want_first)) and first.examples()["id"]
    update_synthetic_store(s3_url, [0, 2, 3], [], CONFIG, seed=3)
    report = gc(s3_url, older_than=0)
    first_only = version_chunks_of(first) - version_chunks_of(second) - current_chunks(s3_url)
    assert report["removed_versions"] == [first.version] and report["removed_chunks"] == len(first_only) > 0
    with second:  # now the previous version: still whole
        assert second.verify_all() == []
    obstore.put(store, "chunks/0123456789abcdef", b"a killed writer's upload")
    assert store_cli(["verify", s3_url, "--absent", "nobody"]) == 1
    assert "chunks/0123456789abcdef is referenced by no version" in capsys.readouterr().out
    assert gc(s3_url, older_than=0)["removed_chunks"] == 1
    assert store_cli(["verify", s3_url, "--absent", "nobody"]) == 0


def version_chunks_of(store: MiloStore) -> set[str]:
    return set(store.placement.ids)


def current_chunks(url) -> set[str]:
    with MiloStore.open(url, tier="disk", block_cache=BlockCache(limit_bytes=0)) as s:
        return set(s.placement.ids)
