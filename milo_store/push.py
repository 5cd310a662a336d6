"""Upload a local store to a store URL, as a format-4 version whose chunks hold at most ``max_chunk_bytes``.

Every block is copied as it is (bytes, ranks and checksums unchanged; a store of format 3 or older is
migrated on the way), and so are the anchor, the demonstrations, token ids and any named index; the BM25
index is written as a format-4 store's (vocabulary and segment postings). The upload commits like a
build to the URL: new chunks and a new version, then the manifest by conditional write.
"""
import numpy as np

from . import format as fmt, text_index
from .compress import write_text
from .errors import StoreCorruptedError, StoreError
from .store import MiloStore
from .urls import is_url
from .writer import StoreLock, StoreWriter

COPIED_AT_ONCE = 64 << 20  # bytes of blocks read from the local store per batch
FORMAT_KEYS = ("format_version", "factor_dtype", fmt.ARRAY_CHECKSUMS, "layout")  # what the writer records itself


def push(local, url: str, *, force: bool = False, max_chunk_bytes: int | None = None) -> str:
    """Check the local store, then publish a copy of it at ``url`` (chunks of at most ``max_chunk_bytes``,
    default `format.MAX_CHUNK_BYTES`); returns the URL."""
    if not is_url(url):
        raise StoreError(f"{url}: not a store URL (s3://bucket/prefix, gs://, az://, file://)")
    with StoreLock(url) as lock, MiloStore.open(local, tier="disk") as store:
        if problems := store.verify_all():
            raise StoreCorruptedError(f"{local}: refusing to upload a damaged store ({problems[0]})")
        attrs = {k: v for k, v in store.meta.items() if k not in FORMAT_KEYS}
        with StoreWriter(url, store.layout, store.ranks, store.block_tokens, dtype=store.dtype, attrs=attrs,
                         force=force, max_chunk_bytes=max_chunk_bytes, lock=lock,
                         block_group=store.block_group if store.grouped else None, codec=store.codec) as w:
            batch = []
            for i in range(store.num_blocks):
                batch.append(i)
                if i == store.num_blocks - 1 or store.block_bytes(batch).sum() >= COPIED_AT_ONCE:
                    for block in store.stored_blocks(batch):
                        w.write_block(block)
                    batch = []
            if (anchor := store.anchor_kv()) is not None:
                w.write_anchor(anchor, store.key_gains(), store.anchor_states())
            examples = store.examples()
            token_ids = None if store.token_ids(0) is None else np.concatenate(
                [store.token_ids(i) for i in range(store.num_blocks)])
            if examples["input"] or token_ids is not None:
                write_text(w, examples, examples["block"], token_ids, store.block_tokens, None, {})
            for name in store.index_names():
                if name != text_index.NAME:
                    attrs, arrays = store.index_arrays(name, check=True)
                    w.write_index(name, arrays, {k: v for k, v in attrs.items() if k != "checksums"})
            return w.commit()
