"""tools/bench_remote.py's raw range GETs read exactly the bytes milo's read path returns for the same blocks:
the reference its milo-over-raw ratios divide by (the tool is otherwise run by hand, against moto)."""
import sys
from pathlib import Path

import numpy as np

from milo_store import Layout, MiloStore
from milo_store.blockcache import BlockCache
from milo_store.urls import open_object_store

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import bench_remote  # noqa: E402


def test_raw_ranges_cover_exactly_the_blocks_milo_reads(s3_url, tmp_path):
    layout = Layout(2, 1, 8)
    ranks = np.full((7, layout.num_layers, 2, layout.num_kv_heads), 2, dtype=np.int16)
    tokens = np.full(7, 5, dtype=np.int32)
    bench_remote.random_store(s3_url, layout, ranks, tokens, chunk_bytes=300)  # several blocks a chunk, several chunks
    ids = [5, 1, 2, 6]
    with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "none", 0)) as store:
        per = bench_remote.raw_ranges(store, ids)
        assert len(per) > 1 and sum(z - a for r in per.values() for a, z in r) == store.block_bytes(ids).sum()
        client = open_object_store(s3_url)
        raw = b"".join(bytes(b) for key, r in per.items()
                       for b in bench_remote.obstore.get_ranges(client, key, starts=[a for a, _ in r],
                                                                ends=[z for _, z in r]))
        milo = b"".join(t.numpy().tobytes() for t in store.blocks(sorted(ids)))
    assert raw == milo
