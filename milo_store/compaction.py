"""Compaction: a new version of a format-4 store without dead bytes, once they pass a share of its chunks.

An update that re-encodes a block whose chunk it keeps (an append fills the last block) leaves that
block's earlier bytes in the chunk, dead: referenced, never read (docs/format.md, "Dead bytes").
`compact` writes a version in which every chunk holding dead bytes is gone, its live blocks written again
into new chunks; every other chunk and every text segment is kept as it is. The dead bytes leave the
disk (or the bucket) when no kept version references their chunks any more: at once in a directory, at a
URL once gc no longer keeps the version compacted (the next replace, or ``gc --only-current``).
"""
from .blockcache import BlockCache
from .push import FORMAT_KEYS
from .store import MiloStore
from .writer import StoreLock, StoreWriter

DEFAULT_THRESHOLD = 0.25  # of the bytes of a version's factor chunks
COPIED_AT_ONCE = 64 << 20  # bytes of live blocks read per batch


def dead_bytes(store: MiloStore) -> dict:
    """What the version's factor chunks hold that none of its blocks uses."""
    dead = store.placement.dead_bytes()
    total = store.placement.factor_chunk_bytes()
    return {"dead_bytes": dead, "chunk_bytes": total, "dead_share": dead / total if total else 0.0}


def compact(location, threshold: float = DEFAULT_THRESHOLD, dry_run: bool = False) -> dict:
    """Compact the store at ``location`` (a directory or URL) when its dead bytes are at least ``threshold``
    of its factor chunks' bytes; returns what it found and, when it compacted, what it rewrote and reclaims."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"the compaction threshold is a share of the chunks' bytes, in [0, 1]; got {threshold}")
    with StoreLock(location) as lock, MiloStore.open(location, tier="disk", verify=False,
                                                     block_cache=BlockCache(limit_bytes=0)) as store:
        report = {"location": str(location), "version": store.version, "threshold": threshold, "compacted": False,
                  **(dead_bytes(store) if store.segmented else {"dead_bytes": 0, "chunk_bytes": 0, "dead_share": 0.0})}
        dirty = set(store.placement.chunk_dead_bytes()) if store.segmented else set()
        if dry_run or not dirty or report["dead_share"] < threshold:
            return report
        moved = [b for b in range(store.num_blocks) if int(store.placement.extents[b, 0]) in dirty]
        attrs = {k: v for k, v in store.meta.items() if k not in FORMAT_KEYS}
        with StoreWriter(location, store.layout, store.ranks, store.block_tokens, dtype=store.dtype, attrs=attrs,
                         lock=lock, block_group=store.block_group if store.grouped else None, codec=store.codec, previous=store,
                         purge=moved) as w:
            copy_blocks(w, store)
            if (anchor := store.anchor_kv()) is not None:
                w.write_anchor(anchor, store.key_gains(), store.anchor_states())
            for k in range(len(store.segment_table)):
                w.keep_segment(k)
            for name in store.index_names():
                attrs, arrays = store.index_arrays(name, check=True)
                w.write_index(name, arrays, {k: v for k, v in attrs.items() if k != "checksums"})
            w.commit()
            report.update(compacted=True, blocks_rewritten=len(moved), bytes_rewritten=w.bytes_written,
                          chunks_dropped=len(dirty), reclaimed_bytes=report["dead_bytes"])
    return report


def copy_blocks(w: StoreWriter, store: MiloStore) -> None:
    """Every block of ``store``, in order: referenced where `StoreWriter.can_keep` allows, read and written
    again otherwise (in batches of COPIED_AT_ONCE bytes)."""
    batch = []
    for b in range(store.num_blocks + 1):
        keep = b < store.num_blocks and w.can_keep(b)
        if batch and (keep or b == store.num_blocks or store.block_bytes(batch).sum() >= COPIED_AT_ONCE):
            for block in store.stored_blocks(batch):
                w.write_block(block)
            batch = []
        if keep:
            w.keep_block(b)
        elif b < store.num_blocks:
            batch.append(b)
