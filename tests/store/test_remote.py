"""Stores on an S3 server (moto on loopback, or MILO_TEST_S3_URL): parity, commit, gc, races, errors, CLI."""
import json
import threading
import uuid

import numpy as np
import obstore
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from milo_store import CompressionConfig, Layout, MiloStore, NotAStoreError, StoreError, StoreWriter
from milo_store.blockcache import BlockCache
from milo_store.cli.main import main as store_cli
from milo_store.errors import FormatVersionError, StoreCorruptedError
from milo_store.format import FORMAT_VERSION
from milo_store.push import push
from milo_store.remote import MANIFEST, RemoteTarget, gc
from milo_store.synthetic import build_synthetic_store
from milo_store.urls import open_object_store

from .conftest import LAYOUT, TOKENS
from .format3 import format3_copy

CONFIG = CompressionConfig(ratio=0.5)


def _versions(url):
    return sorted({o["path"].split("/")[1] for batch in obstore.list(open_object_store(url), prefix="v/") for o in batch})


def _manifest(url):
    return json.loads(bytes(obstore.get(open_object_store(url), MANIFEST).bytes()))


def _blocks(store):
    return [store.block(i).clone() for i in range(store.num_blocks)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 6), st.sampled_from(["float16", "bfloat16", "int8"]), st.sampled_from([64, 200, 1 << 20]),
       st.lists(st.integers(0, 5), max_size=8), st.integers(0, 999))
def test_any_blocks_read_from_an_object_store_are_byte_exact(tmp_path_factory, n, dtype, chunk_bytes, picks, seed):
    """Ragged blocks across chunk objects of any size, any subset (repeats, out of order): the bytes written."""
    rng = np.random.default_rng(seed)
    layout = Layout(2, 1, 8, "int8" if dtype == "int8" else None)
    tokens = rng.integers(1, 20, n)
    ranks = np.minimum(rng.integers(0, 9, (n, 2, 2, 1)), tokens.reshape(-1, 1, 1, 1))
    offsets = layout.block_offsets(ranks, tokens)
    tdtype = torch.uint8 if dtype == "int8" else getattr(torch, dtype)
    blocks = [torch.randint(0, 255, (int(offsets[i + 1] - offsets[i]),), dtype=torch.uint8) if dtype == "int8"
              else torch.randn(int(offsets[i + 1] - offsets[i])).to(tdtype) for i in range(n)]
    url = f"memory://milo-test-prop-{uuid.uuid4().hex[:8]}"
    with StoreWriter(url, layout, ranks, tokens, dtype=dtype, max_chunk_bytes=chunk_bytes) as w:
        for b in blocks:
            w.write_block(b)
        w.commit()
    ids = [i % n for i in picks]
    with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path_factory.mktemp("c"))) as s:
        got = s.blocks(ids)
        assert all(torch.equal(g.view(torch.uint8), blocks[i].view(torch.uint8)) for i, g in zip(ids, got))
        assert s.remote_stats()["bytes"] == sum(blocks[i].numel() * blocks[i].element_size() for i in set(ids))


def test_remote_store_matches_the_local_one(tmp_path, s3_url):
    local = build_synthetic_store(tmp_path / "local", LAYOUT, TOKENS, CONFIG, seed=3)
    url = build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=3)
    assert url == s3_url
    cache = BlockCache(tmp_path / "cache")
    with MiloStore.open(local, tier="disk") as a, MiloStore.open(url, tier="disk", block_cache=cache) as b:
        assert np.array_equal(a.ranks, b.ranks) and np.array_equal(a.checksums, b.checksums)
        assert np.array_equal(a.block_tokens, b.block_tokens)
        assert all(torch.equal(x, y) for x, y in zip(_blocks(a), _blocks(b)))
        assert torch.equal(a.anchor_kv(), b.anchor_kv()) and a.examples() == b.examples()
        assert b.verify_all() == []
        fetched = b.remote_stats()["bytes"]
        assert fetched >= int(a.offsets[-1]) * a.itemsize  # every block came over the network once...
        _blocks(b)
        assert b.remote_stats()["bytes"] == fetched  # ...and then from the block cache
        assert cache.hits == a.num_blocks and cache.check() == []
        assert a.accounting()["factor_bytes"] == b.accounting()["factor_bytes"]
    with MiloStore.open(url, tier="host", block_cache=BlockCache(tmp_path / "cache2")) as h, MiloStore.open(local) as a:
        assert all(torch.equal(x, y) for x, y in zip(_blocks(a), _blocks(h)))


def test_stores_with_raw_units_publish_their_format_version(tmp_path, s3_url):
    """Written to a URL or pushed there, a store holding raw units says its version in its manifest too."""
    frontier = CompressionConfig(ratio=0.5, dtype="int8", policy="frontier")
    local = build_synthetic_store(tmp_path / "local", LAYOUT, TOKENS, frontier, seed=3)
    written = build_synthetic_store(s3_url + "-written", LAYOUT, TOKENS, frontier, seed=3)
    pushed = push(local, s3_url + "-pushed")
    with MiloStore.open(local) as a:
        assert (a.ranks < 0).any() and a.meta["format_version"] == FORMAT_VERSION
        for url in (written, pushed):
            assert _manifest(url)["format_version"] == FORMAT_VERSION
            with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as b:
                assert np.array_equal(a.ranks, b.ranks) and all(torch.equal(x, y) for x, y in zip(_blocks(a), _blocks(b)))


def test_commit_refuses_overwrite_and_force_replaces_while_readers_stay_pinned(tmp_path, s3_url):
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    with pytest.raises(StoreError, match="already holds a store"):
        build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=2)
    old = MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c"))
    old_blocks = _blocks(old)
    first = _manifest(s3_url)["version"]
    assert old.version == MiloStore.current_version(s3_url) == first
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=2, force=True)
    m = _manifest(s3_url)
    assert m["previous"] == first and m["version"] != first
    assert MiloStore.current_version(s3_url) == m["version"] and old.version == first  # the mount stays pinned
    with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as new:
        assert not all(torch.equal(x, y) for x, y in zip(old_blocks, _blocks(new)))
    assert all(torch.equal(x, y) for x, y in zip(old_blocks, [old.block(i) for i in range(old.num_blocks)]))  # pinned
    old.close()
    # gc keeps the current and previous versions; a third build makes the first garbage
    assert gc(s3_url, older_than=0)["removed_versions"] == []
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=4, force=True)
    report = gc(s3_url, older_than=0)
    assert report["removed_versions"] == [first]
    assert _versions(s3_url) == sorted({m["version"], _manifest(s3_url)["version"]})
    assert gc(s3_url, older_than=3600)["removed_versions"] == []


def test_two_racing_writers_exactly_one_wins(tmp_path, s3_url):
    stores = [build_synthetic_store(tmp_path / f"local{k}", LAYOUT, TOKENS, CONFIG, seed=1) for k in range(2)]
    for force in (False, True):
        targets = [RemoteTarget(s3_url, force=force) for _ in range(2)]  # both saw the same manifest (or none)
        results, barrier = [None, None], threading.Barrier(2)

        def publish(k):
            barrier.wait()
            try:
                results[k] = targets[k].publish(stores[k], FORMAT_VERSION)
            except StoreError as e:
                results[k] = e

        threads = [threading.Thread(target=publish, args=(k,)) for k in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        winners = [r for r in results if r == s3_url]
        losers = [r for r in results if isinstance(r, StoreError)]
        assert len(winners) == 1 and len(losers) == 1, results
        assert "lost the race" in str(losers[0])
        with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as s:
            assert s.verify_all() == []


def test_clear_errors_naming_the_url(tmp_path, s3_url, monkeypatch, capsys):
    with pytest.raises(NotAStoreError, match="no milo store here"):
        MiloStore.open(s3_url)
    bucket = s3_url.split("/")[2]
    with pytest.raises(NotAStoreError, match="no such bucket"):
        MiloStore.open(s3_url.replace(bucket, "milo-no-such-bucket"))
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG)
    m = _manifest(s3_url)
    obstore.put(open_object_store(s3_url), MANIFEST, json.dumps({**m, "format_version": 99}).encode())
    with pytest.raises(FormatVersionError, match=f"{s3_url}: store format version 99"):
        MiloStore.open(s3_url)
    obstore.put(open_object_store(s3_url), MANIFEST, json.dumps({**m, "milo_manifest": 7}).encode())
    with pytest.raises(FormatVersionError, match="manifest format 7"):
        MiloStore.open(s3_url)
    obstore.put(open_object_store(s3_url), MANIFEST, json.dumps({**m, "version": "../elsewhere"}).encode())
    with pytest.raises(StoreCorruptedError, match="unreadable manifest.json"):
        MiloStore.open(s3_url)
    assert store_cli(["stat", s3_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and s3_url in err and "Traceback" not in err
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("MILO_REMOTE_RETRIES", "1")
    with pytest.raises(StoreError, match=f"{s3_url}: cannot reach the object store"):
        MiloStore.open(s3_url)


def test_cli_on_a_url(tmp_path, s3_url, capsys):
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG)
    cache = str(tmp_path / "cache")
    assert store_cli(["verify", s3_url]) == 0
    assert store_cli(["stat", s3_url, "--json"]) == 0
    assert store_cli(["ls", s3_url]) == 0
    out = capsys.readouterr().out
    assert f"{s3_url}: {len(TOKENS)} blocks, OK" in out and f'"path": "{s3_url}"' in out
    with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(cache)) as s:
        _blocks(s)
    assert store_cli(["cache", "stat", "--cache-dir", cache, "--verify", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["files"] == len(TOKENS) and info["bad_files"] == [] and info["stores"] == 1
    assert store_cli(["cache", "clear", "--cache-dir", cache]) == 0
    assert "removed 4 files" in capsys.readouterr().out and BlockCache(cache).stat()["files"] == 0
    assert store_cli(["gc", s3_url, "--older-than", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed_versions"] == []
    assert store_cli(["gc", str(tmp_path)]) == 2


def test_push_rechunks_and_keeps_every_byte(tmp_path, s3_url, capsys):
    local = build_synthetic_store(tmp_path / "local", LAYOUT, TOKENS, CONFIG, seed=8)
    older = format3_copy(local, tmp_path / "v3")  # a format-3 store is pushed as format 4
    assert store_cli(["push", str(older), s3_url + "-from-3"]) == 0
    capsys.readouterr()
    with MiloStore.open(local, tier="disk") as a, MiloStore.open(s3_url + "-from-3", tier="disk",
                                                                 block_cache=BlockCache(tmp_path / "c3")) as b:
        assert b.format_version == FORMAT_VERSION and all(torch.equal(x, y) for x, y in zip(_blocks(a), _blocks(b)))
        assert b.examples() == a.examples() and b.verify_all() == []
    assert store_cli(["push", str(local), s3_url, "--chunk-size", "2K"]) == 0
    assert capsys.readouterr().out.strip() == s3_url
    with MiloStore.open(local, tier="disk") as a, MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as b:
        largest = int(b.block_bytes(range(b.num_blocks)).max())
        assert len(b.placement.sizes) > len(a.placement.sizes)  # smaller chunk objects: whole blocks, up to 2K
        assert max(b.placement.sizes[c] for c in b.placement.extents[:, 0]) <= max(2048, largest)
        assert all(torch.equal(x, y) for x, y in zip(_blocks(a), _blocks(b)))
        assert b.examples() == a.examples() and torch.equal(a.anchor_kv(), b.anchor_kv())
        unlike = ("array_checksums",)  # chunk ids differ: the push wrote new chunks
        assert {k: v for k, v in b.meta.items() if k not in unlike} == {k: v for k, v in a.meta.items() if k not in unlike}
    assert store_cli(["push", str(local), s3_url]) == 2  # already there, no --force
    assert "already holds a store" in capsys.readouterr().err


def test_memory_and_file_urls(tmp_path):
    for url in ("memory://milo-test-urls", f"file://{tmp_path}/fs-store"):
        build_synthetic_store(url, LAYOUT, TOKENS, CONFIG, seed=5)
        build_synthetic_store(url, LAYOUT, TOKENS, CONFIG, seed=6, force=True)
        with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as s:
            assert s.verify_all() == [] and s.num_blocks == len(TOKENS)


def test_a_killed_writers_upload_folder_is_cleared_by_the_next(s3_url, tmp_path, monkeypatch):
    """The local copy of a store being uploaded lives beside milo's other files, not in /tmp, and a
    writer holding the URL's lock clears what a killed one left there."""
    from milo_store.urls import local_sidecar

    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    leftover = local_sidecar(s3_url, "upload") / "store" / "factors"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_bytes(b"x" * 100)
    url = build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=7)
    assert str(local_sidecar(s3_url, "upload")).startswith(str(tmp_path / "cache"))
    assert not (leftover / "junk").exists()
    with MiloStore.open(url, block_cache=BlockCache(tmp_path / "blocks")) as store:
        assert store.verify_all() == []


def test_a_mount_whose_pinned_version_was_removed_says_so(tmp_path, s3_url):
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    old = MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c"))
    for seed in (2, 3):  # two replaces: the pinned version is neither current nor previous
        build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=seed, force=True)
    assert len(gc(s3_url, older_than=0)["removed_versions"]) == 1
    with old:
        for read in (old.examples, old.anchor_kv):
            with pytest.raises(StoreError, match="which this mount pinned, was removed"):
                read()
    with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as new:
        assert len(new.examples()["input"]) == len(TOKENS) and new.anchor_kv() is not None


def test_gc_of_a_prefix_without_a_store_is_an_error(s3_url, capsys):
    with pytest.raises(NotAStoreError, match="no milo store here"):
        gc(s3_url + "-typo")
    assert store_cli(["gc", s3_url + "-typo"]) == 2
    assert "no milo store here" in capsys.readouterr().err
