"""Stores of format 3, as milo wrote them before format 4: one factor array in equal chunks, the
demonstrations, token ids and a BM25 index of precomputed weights in arrays of their own. Made here from a
format-4 store's contents, for the tests that format-3 stores still mount, answer and migrate."""
from pathlib import Path

import numpy as np
import zarr

from milo_store import MiloStore
from milo_store import format as fmt
from milo_store.checksum import crc32c
from milo_store.text_index import build_text_index, index_attrs


def format3_copy(source, dest, chunk_bytes: int = 64 << 20) -> Path:
    """The store at ``source`` written again at ``dest`` in format 3 (factor chunks of at most ``chunk_bytes``)."""
    dest = Path(dest)
    with MiloStore.open(source, tier="disk") as s:
        g = zarr.open_group(str(dest), mode="w")
        total = int(s.offsets[-1])
        per = max(1, chunk_bytes // s.itemsize)
        chunk = max(1, -(-total // max(1, -(-total // per))))  # equal chunks, the padded last one wasting least
        factors = g.create_array(fmt.FACTORS, shape=(total,), dtype=fmt.NUMPY_DTYPES[s.dtype], chunks=(chunk,),
                                 compressors=None, fill_value=0, config={"write_empty_chunks": True})
        for i in range(s.num_blocks):
            factors[int(s.offsets[i]):int(s.offsets[i + 1])] = fmt.to_numpy(s.block(i))
        sums = {}

        def put(name: str, data, **kw):
            g.create_array(name, data=data, **kw)
            sums[name] = fmt.array_checksum(data)

        put(fmt.RANKS, s.ranks.astype(np.int16))
        put(fmt.TOKENS, s.block_tokens.astype(np.int32))
        put(fmt.CHECKSUMS, s.checksums.astype(np.uint32))
        if s.grouped:
            put(fmt.BLOCK_GROUP, s.block_group.astype(np.int32))
        if (anchor := s.anchor_kv()) is not None:
            put(fmt.ANCHOR, fmt.to_numpy(anchor), compressors=None)
        if s.num_blocks and s.token_ids(0) is not None:
            put(fmt.TOKEN_IDS, np.concatenate([s.token_ids(i) for i in range(s.num_blocks)]).astype(np.int32))
        ex = s.examples()
        if ex["input"]:
            e = g.create_group(fmt.EXAMPLES)
            for name in ("input", "output", "id"):
                values = np.array(ex[name], dtype=object)
                e.create_array(name, shape=values.shape, dtype=str)[:] = values
                sums[f"{fmt.EXAMPLES}/{name}"] = fmt.array_checksum(values)
            put(f"{fmt.EXAMPLES}/block", np.asarray(ex["block"], dtype=np.int32))
            index = g.require_group(fmt.INDEXES).create_group("bm25")
            arrays = build_text_index(ex["input"], ex["block"], s.num_blocks)
            for key, data in arrays.items():
                index.create_array(key, shape=data.shape, dtype=data.dtype, chunks=(max(1, len(data)),),
                                   compressors=None, fill_value=0, config={"write_empty_chunks": True})[:] = data
            index.attrs.update({**index_attrs(), "checksums": {k: crc32c(a) for k, a in arrays.items()}})
        meta = {k: v for k, v in s.meta.items() if k != fmt.ARRAY_CHECKSUMS}
        g.attrs[fmt.ATTRS_KEY] = {**meta, "format_version": fmt.CHECKED_VERSION, fmt.ARRAY_CHECKSUMS: sums}
    return dest
