"""Readers stay warm across a hot swap: after `milo update` removes a demonstration, a server's mount of the new
version finds every block the update kept in the caches its old mount filled (the block cache of a store URL,
the shared memory cache of the cached tier, the device tier), and reads from the store only the blocks the
update encoded. Format-4 caches key a block by its chunk, offset, length and CRC32C, which every version
keeping it shares (docs/format.md, "Format 4").

The tiny random Llama of the build tests; stores of blocks of 2 demonstrations with 1 context block, a chunk
per block (so a removal's purge drops no kept block's chunk).
"""
import pytest

from milo_infer.building.update import update_store
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import Request
from milo_infer.server.metrics import ServerMetrics
from milo_infer.server.reload import StoreReloader
from milo_store import MiloStore
from milo_store import format as fmt
from milo_store.blockcache import BlockCache
from milo_store.sources import MemoryCache, ReadStats

from ..building.test_build import tiny, tiny_model_dir, tokenizer  # noqa: F401 (fixtures)
from ..building.test_update import build, demo
from .test_hot_swap import QUERIES, SETTINGS, seen


@pytest.fixture(autouse=True)
def a_chunk_per_block(monkeypatch):
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", 1)


def serve(tiny, location, open_store, **engine_options):
    """An engine serving the store at ``location`` as the server does, its reloader, and every block read
    once through it (what the caches hold before the swap)."""
    engine = Engine(tiny, {"banking": open_store(location)}, SETTINGS, **engine_options)
    reloader = StoreReloader(engine, {"banking": str(location)}, open_store, ServerMetrics(engine.stores))
    store = engine.stores["banking"].store
    engine.answer([engine.plan("banking", Request(QUERIES[0]), block_ids=[b, b + 1])  # every block, two a query
                   for b in range(0, store.num_blocks, 2)])
    return engine, reloader


def swap_after_removing(tiny, engine, reloader, location) -> tuple[MiloStore, dict]:
    old = engine.stores["banking"].store
    summary = update_store(location, tiny, remove=["d4"], progress=False)  # block 2 [d4, d5] -> [d5]; block 3 too
    [looked] = reloader.reload()
    assert looked.previous == old.version and looked.error is None
    new = engine.stores["banking"].store
    kept = [i for i in range(new.num_blocks) if new.block_key(i) in {old.block_key(b) for b in range(old.num_blocks)}]
    assert summary["blocks_encoded_now"] == 2 and len(kept) == new.num_blocks - 2 == summary["blocks_kept"]
    return new, summary


def answers_equal_a_fresh_mount(tiny, engine, location):
    got = [seen(a) for a in engine.answer([engine.plan("banking", Request(q)) for q in QUERIES])]
    with MiloStore.open(location, tier="disk") as fresh:
        alone = Engine(tiny, {"banking": fresh}, SETTINGS)
        assert got == [seen(a) for a in alone.answer([alone.plan("banking", Request(q)) for q in QUERIES])]


def test_after_a_swap_a_url_store_fetches_only_the_blocks_the_update_encoded(tiny, tmp_path, s3_url, monkeypatch):
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "milo"))
    build(tiny, s3_url, [demo(i) for i in range(12)])
    cache = BlockCache(tmp_path / "blocks")
    engine, reloader = serve(tiny, s3_url, lambda location: MiloStore.open(location, tier="disk", block_cache=cache))
    new, summary = swap_after_removing(tiny, engine, reloader, s3_url)
    fetched = ReadStats()
    new.blocks(list(range(new.num_blocks)), fetched)
    assert fetched.block_cache_misses == summary["blocks_encoded_now"] == 2
    assert fetched.block_cache_hits == new.num_blocks - 2 and fetched.remote_gets == 2
    assert fetched.remote_bytes == int(new.block_bytes([2, 3]).sum())  # the re-encoded blocks, nothing else
    answers_equal_a_fresh_mount(tiny, engine, s3_url)


def test_after_a_swap_the_shared_memory_cache_and_the_device_tier_hold_the_kept_blocks(tiny, tmp_path):
    location = build(tiny, tmp_path / "banking", [demo(i) for i in range(12)])
    memory = MemoryCache(1 << 30)
    engine, reloader = serve(tiny, location, lambda path: MiloStore.open(path, tier="cached", memory_cache=memory),
                             device_cache_bytes=1 << 30)
    resident = engine.device_tier.stats()["blocks"]
    new, _ = swap_after_removing(tiny, engine, reloader, location)
    on_device = [i for i in range(new.num_blocks) if engine.device_tier.get(new.block_key(i)) is not None]
    assert on_device == [0, 1, 4, 5] and resident == 6
    read = ReadStats()
    new.blocks(list(range(new.num_blocks)), read)
    assert read.memory_hits == new.num_blocks - 2  # only blocks 2 and 3, encoded anew, come from the files
    answers_equal_a_fresh_mount(tiny, engine, location)
