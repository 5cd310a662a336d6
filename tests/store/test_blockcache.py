"""The block cache: checked on fill and read, LRU by bytes, shared by several reader processes."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from milo_store import CompressionConfig, MiloStore
from milo_store.blockcache import BlockCache, parse_size
from milo_store.checksum import crc32c
from milo_store.synthetic import build_synthetic_store

from .conftest import LAYOUT

MANY_TOKENS = [17, 40, 9, 31, 25, 12, 33, 28, 19, 40, 22, 30]


def _files(cache: BlockCache):
    """The entry files (the marker beside them is not one)."""
    return sorted(p for p in cache.dir.rglob("*") if p.is_file() and p.parent != cache.dir)


def test_lru_by_bytes(tmp_path):
    data = [memoryview(bytes([i]) * 100) for i in range(4)]
    cache = BlockCache(tmp_path, limit_bytes=250)
    for i in range(3):
        cache.put("k", i, i, data[i])
        os.utime(cache._file("k", i, i), (1000 + i, 1000 + i))
    assert not cache.read_into("k", 0, 0, memoryview(bytearray(100)))  # the name's checksum is not the bytes'
    assert not cache._file("k", 0, 0).exists()  # so the file was dropped
    cache.put("k", 3, 3, data[3])
    assert cache.evict() == 1 and cache.stat()["bytes"] == 200
    assert not cache._file("k", 1, 1).exists()  # the least recently used went first


def test_corrupt_or_truncated_cache_files_are_refetched(tmp_path):
    url = build_synthetic_store("memory://milo-test-cache", LAYOUT, MANY_TOKENS[:4], CompressionConfig(ratio=0.5), force=True)
    cache = BlockCache(tmp_path / "cache")
    with MiloStore.open(url, tier="disk", block_cache=cache) as s:
        want = [s.block(i).clone() for i in range(s.num_blocks)]
        files = _files(cache)
        assert len(files) == 4 and cache.check() == []
        raw = bytearray(files[0].read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        files[0].write_bytes(bytes(raw))
        files[1].write_bytes(files[1].read_bytes()[:-3])
        files[2].write_bytes(files[2].read_bytes() + b"x")
        assert len(cache.check()) == 3
        fetched = s.remote_stats()["bytes"]
        assert all(torch.equal(w, s.block(i)) for i, w in enumerate(want))
        assert cache.dropped == 3 and s.remote_stats()["bytes"] > fetched
        assert cache.check() == []


def test_parse_size():
    assert parse_size("512M") == 512 << 20 and parse_size("10GiB") == 10 << 30 and parse_size("123") == 123
    with pytest.raises(ValueError):
        parse_size("lots")


READER = r"""
import hashlib, json, random, sys
from milo_store import MiloStore
from milo_store.blockcache import BlockCache
url, cache_dir, limit, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
with MiloStore.open(url, tier="disk", block_cache=BlockCache(cache_dir, limit)) as s:
    digests = {}
    for _ in range(6):
        ids = rng.sample(range(s.num_blocks), 4)
        for i, b in zip(ids, s.blocks(ids)):
            d = hashlib.sha256(b.numpy().tobytes()).hexdigest()
            assert digests.setdefault(i, d) == d
    print(json.dumps({"digests": digests, "remote": s.remote_stats()}))
"""


def test_four_readers_share_one_cache_past_its_limit(tmp_path, s3_url):
    local = build_synthetic_store(tmp_path / "local", LAYOUT, MANY_TOKENS, CompressionConfig(ratio=0.5), seed=7)
    url = build_synthetic_store(s3_url, LAYOUT, MANY_TOKENS, CompressionConfig(ratio=0.5), seed=7)
    with MiloStore.open(local, tier="disk") as s:
        want = {str(i): hashlib.sha256(s.block(i).numpy().tobytes()).hexdigest() for i in range(s.num_blocks)}
        total = int(s.offsets[-1]) * s.itemsize
    limit = total // 3  # the cache holds a third of the store: the readers keep evicting each other's blocks
    cache_dir = tmp_path / "shared-cache"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", READER, url, str(cache_dir), str(limit), str(k)],
                              stdout=subprocess.PIPE, text=True, env=env) for k in range(4)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for r in results:
        assert all(want[i] == d for i, d in r["digests"].items())
    cache = BlockCache(cache_dir, limit)
    assert cache.check() == [] and cache.stat()["bytes"] <= limit
    cold = subprocess.run([sys.executable, "-c", READER, url, str(tmp_path / "cold-cache"), str(10 * total), "0"],
                          capture_output=True, text=True, env=env, timeout=120, check=True)
    cold_bytes = json.loads(cold.stdout)["remote"]["bytes"]
    shared_bytes = sum(r["remote"]["bytes"] for r in results)
    print(f"\n4 readers sharing a cache of 1/3 of the store fetched {shared_bytes} bytes; one cold reader "
          f"with room for all {cold_bytes} ({shared_bytes / cold_bytes:.2f}x); store factors {total} bytes")
    assert cold_bytes <= total


def test_cache_io_errors_are_misses_not_failures(tmp_path, monkeypatch):
    """A cache on a path that cannot hold it, or cleared while in use, never fails the read it serves."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    cache = BlockCache(blocker / "cache", 1 << 20)
    data = np.arange(64, dtype=np.uint8)
    crc = crc32c(data)
    with pytest.warns(UserWarning, match="continuing without it"):
        cache.put("s", 0, crc, memoryview(data))  # mkdir fails: NotADirectoryError
    assert not cache.read_into("s", 0, crc, memoryview(np.zeros(64, dtype=np.uint8)))
    assert cache.evict() == 0

    cache = BlockCache(tmp_path / "cache", 1)
    cache.put("s", 0, crc, memoryview(data[:1]))
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: (_ for _ in ()).throw(FileNotFoundError(p))
                        if str(p).endswith("/s") else real(p))  # `milo-store cache clear` between the two levels
    cache.put("s", 1, crc32c(data[:1]), memoryview(data[:1]))
    assert cache.evict() == 0


def test_clear_refuses_a_directory_the_cache_did_not_mark_and_counts_only_its_entries(tmp_path, capsys):
    from milo_store.cli.main import main as store_cli
    foreign = tmp_path / "notes"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "todo.txt").write_text("hi")
    (foreign / "sub" / "1.0000abcd").write_bytes(b"ab")  # named like an entry, but no marker: not the cache's
    assert store_cli(["cache", "clear", "--cache-dir", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a milo block cache" in err
    assert (foreign / "todo.txt").read_text() == "hi" and (foreign / "sub" / "1.0000abcd").exists()

    cache = BlockCache(tmp_path / "cache", limit_bytes=3 << 20)
    data = np.arange(64, dtype=np.uint8)
    for block in range(2):
        cache.put("store-a", block, crc32c(data), memoryview(data))
    stray = cache.dir / "store-a" / "readme.txt"  # a file someone left in the cache is not an entry
    stray.write_text("mine")
    assert store_cli(["cache", "stat", "--cache-dir", str(cache.dir)]) == 0
    assert "2 blocks of 1 store version(s), 128 B of 3.00 MiB (last used limit)" in capsys.readouterr().out
    assert store_cli(["cache", "clear", "--cache-dir", str(cache.dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["removed_files"], info["removed_bytes"]) == (2, 128)
    assert stray.read_text() == "mine" and cache.dir.is_dir()
    assert store_cli(["cache", "stat", "--cache-dir", str(tmp_path / "fresh")]) == 0
    assert "of 10.00 GiB (default limit)" in capsys.readouterr().out
