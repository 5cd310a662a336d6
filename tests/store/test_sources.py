"""Byte sources composed into tiers: the cached tier's LRU, per-call read statistics, and both kept
consistent by callers on several threads (the shared state is swapped for versions that yield the GIL
inside every update, so a missing lock loses updates every time rather than once in a while)."""
import os
import sys
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from milo_store import CompressionConfig, MiloStore
from milo_store.blockcache import BlockCache
from milo_store.sources import BlockCacheSource, ByteSource, ChunkFiles, MemoryLRU, ObjectChunks, ReadStats, requests
from milo_store.synthetic import build_synthetic_store

from .conftest import LAYOUT
from .test_blockcache import MANY_TOKENS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from loopback_proxy import LoopbackProxy  # noqa: E402


@pytest.fixture
def many_blocks(tmp_path):
    return build_synthetic_store(tmp_path / "store", LAYOUT, MANY_TOKENS, CompressionConfig(ratio=0.5), seed=4)


class YieldingDict(OrderedDict):
    """An LRU's entries that let other threads run inside each change."""

    def __setitem__(self, key, value):
        time.sleep(1e-4)
        super().__setitem__(key, value)

    def popitem(self, last=True):
        time.sleep(1e-4)
        return super().popitem(last)


class YieldingStats(ReadStats):
    """Running totals that let other threads run between reading a count and storing its sum."""

    def __setattr__(self, name, value):
        time.sleep(1e-5)
        super().__setattr__(name, value)


def _nbytes(store, i) -> int:
    return int(store.offsets[i + 1] - store.offsets[i]) * store.itemsize


def _hammer(work, threads: int = 8) -> list:
    """Run ``work(t)`` on several threads at once; their results, or the first exception raised."""
    results, errors = [None] * threads, []

    def run(t):
        try:
            results[t] = work(t)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if errors:
        raise errors[0]
    return results


def test_every_source_has_the_contract(many_blocks, tmp_path):
    url = build_synthetic_store(f"memory://milo-test-src-{uuid.uuid4().hex[:8]}", LAYOUT, MANY_TOKENS[:2], seed=1)
    with MiloStore.open(many_blocks, tier="cached") as local, \
            MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as remote:
        assert isinstance(local.origin, ChunkFiles) and isinstance(local.source, MemoryLRU)
        assert isinstance(remote.origin, ObjectChunks) and isinstance(remote.source, BlockCacheSource)
        assert all(isinstance(s, ByteSource) for s in (local.origin, local.source, remote.origin, remote.source))


def test_cached_tier_is_sized_by_memory_cache_bytes_and_serves_hits_from_memory(many_blocks):
    with MiloStore.open(many_blocks, tier="disk") as disk:
        want = [disk.block(i).clone() for i in range(disk.num_blocks)]
        limit = _nbytes(disk, 1) + _nbytes(disk, 3)
    with MiloStore.open(many_blocks, tier="cached", memory_cache_bytes=limit) as store:
        first, again = ReadStats(), ReadStats()
        assert all(torch.equal(g, want[i]) for i, g in zip([1, 3], store.blocks([1, 3], first)))
        got = store.blocks([3, 1, 3], again)
        assert all(torch.equal(g, want[i]) for i, g in zip([3, 1, 3], got))
        assert first.memory_hits == 0 and again.memory_hits == 2
        got[0].zero_()  # a caller writing into its block changes no one else's
        assert torch.equal(store.block(3), want[3])
        assert _nbytes(store, 5) <= _nbytes(store, 1)
        store.blocks([5])  # past the limit: the least recently used, block 1, makes room
        lru = store.source.cache
        assert list(lru.entries) == [store.block_key(3), store.block_key(5)]
        assert lru.bytes == _nbytes(store, 3) + _nbytes(store, 5)
    with pytest.raises(ValueError, match="memory_cache_bytes"):
        MiloStore.open(many_blocks, tier="cached", memory_cache_bytes=-1)


def test_cached_tier_lru_stays_consistent_with_threads(many_blocks):
    with MiloStore.open(many_blocks, tier="disk") as disk:
        want = [disk.block(i).clone() for i in range(disk.num_blocks)]
        limit = sum(_nbytes(disk, i) for i in range(4))
    with MiloStore.open(many_blocks, tier="cached", memory_cache_bytes=limit) as store:
        store.source.cache.entries = YieldingDict()

        def work(t):
            rng = np.random.default_rng(t)
            for _ in range(40):
                ids = rng.choice(store.num_blocks, size=3).tolist()
                assert all(torch.equal(g, want[i]) for i, g in zip(ids, store.blocks(ids)))
        _hammer(work)
        lru = store.source.cache
        assert lru.bytes == sum(len(v) for v in lru.entries.values()) <= limit  # the byte count never drifted


def test_remote_totals_and_per_call_stats_with_threads(tmp_path):
    url = build_synthetic_store(f"memory://milo-test-src-{uuid.uuid4().hex[:8]}", LAYOUT, MANY_TOKENS, seed=2)
    with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "none", 0)) as store:  # caches nothing
        store._totals = YieldingStats()

        def work(t):
            rng = np.random.default_rng(t)
            own = []
            for _ in range(60):
                ids = sorted(set(rng.choice(store.num_blocks, size=2).tolist()))
                stats = ReadStats()
                store.blocks(ids, stats)
                assert stats.remote_bytes == sum(_nbytes(store, i) for i in ids)  # this call's, not a neighbour's
                assert stats.block_cache_misses == len(ids) and stats.block_cache_hits == 0
                own.append(stats.remote_bytes)
            return sum(own)
        fetched = sum(_hammer(work))
        assert store.remote_stats()["bytes"] == fetched  # no increment lost between threads


def test_block_cache_hits_are_reported_per_call(tmp_path):
    url = build_synthetic_store(f"memory://milo-test-src-{uuid.uuid4().hex[:8]}", LAYOUT, MANY_TOKENS[:4], seed=3)
    with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as store:
        cold, warm = ReadStats(), ReadStats()
        store.blocks([0, 2], cold)
        store.blocks([2, 0, 2], warm)
        assert (cold.block_cache_misses, cold.block_cache_hits, cold.remote_gets > 0) == (2, 0, True)
        assert (warm.block_cache_misses, warm.block_cache_hits, warm.remote_bytes, warm.remote_gets) == (0, 2, 0, 0)
        assert cold.remote_bytes == _nbytes(store, 0) + _nbytes(store, 2) == store.remote_stats()["bytes"]


def test_counted_gets_and_bytes_are_what_crossed_the_link(tmp_path, s3_url, monkeypatch):
    """obstore merges touching ranges into one GET; the counts must match what the server was asked."""
    url = build_synthetic_store(s3_url, LAYOUT, MANY_TOKENS, CompressionConfig(ratio=0.5), seed=5)
    with LoopbackProxy(os.environ["AWS_ENDPOINT_URL"]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "none", 0)) as store:
            for ids in ([0, 1, 2], [3, 7, 8, 11], [5]):  # adjacent blocks, and scattered ones
                gets, body = proxy.counts["gets"], proxy.counts["body_bytes"]
                stats = ReadStats()
                store.blocks(ids, stats)
                assert stats.remote_gets == proxy.counts["gets"] - gets
                assert stats.remote_bytes == proxy.counts["body_bytes"] - body == sum(_nbytes(store, i) for i in ids)


def test_requests_merge_touching_and_near_ranges():
    assert requests([(200, 300), (0, 100), (100, 200)], 0) == [(0, 300)]
    assert requests([(0, 100), (150, 300)], 0) == [(0, 100), (150, 300)]
    assert requests([(0, 100), (150, 300)], 50) == [(0, 300)]
    assert requests([(0, 100), (50, 80)], 0) == [(0, 100)]
