"""Upload a local store to a store URL, its factor array re-chunked for object storage.

Every file but the factor array is copied as it is (whatever arrays the store holds); the factor
array is rewritten with chunks of at most ``max_chunk_bytes`` (docs/format.md, "Chunk objects"), so
block offsets, bytes and checksums are unchanged. The upload commits like a build to the URL: a new
version, then the manifest by conditional write.
"""
import contextlib
import shutil
from pathlib import Path

import torch
import zarr

from . import format as fmt
from .errors import StoreCorruptedError, StoreError
from .remote import REMOTE_CHUNK_BYTES, RemoteTarget
from .store import MiloStore
from .urls import is_url
from .writer import StoreLock, fresh_upload_dir


def push(local, url: str, *, force: bool = False, max_chunk_bytes: int = REMOTE_CHUNK_BYTES) -> str:
    """Check the local store, then publish a copy of it at ``url``; returns the URL."""
    if not is_url(url):
        raise StoreError(f"{url}: not a store URL (s3://bucket/prefix, gs://, az://, file://)")
    local = Path(local)
    with StoreLock(url), MiloStore.open(local, tier="disk") as store:
        if problems := store.verify_all():
            raise StoreCorruptedError(f"{local}: refusing to upload a damaged store ({problems[0]})")
        target = RemoteTarget(url, force)
        with assembled(url) as copy:
            shutil.copytree(local, copy, ignore=lambda d, names: [fmt.FACTORS] if Path(d) == local else [])
            total = int(store.offsets[-1])
            np_dtype = fmt.NUMPY_DTYPES[store.dtype]
            chunk = fmt.chunk_values(total, store.itemsize, max_chunk_bytes)
            factors = zarr.open_group(str(copy), mode="r+").create_array(
                fmt.FACTORS, shape=(total,), dtype=np_dtype, chunks=(chunk,), compressors=None, fill_value=0,
                config={"write_empty_chunks": True})
            buf = torch.empty(chunk, dtype=store.torch_dtype)
            for start in range(0, total, chunk):
                stop = min(start + chunk, total)
                store.read_range(start, stop, buf)
                factors[start:stop] = fmt.to_numpy(buf[:stop - start])
            return target.publish(copy, store.meta["format_version"])


@contextlib.contextmanager
def assembled(url: str):
    """A fresh local folder for the copy to upload (see `fresh_upload_dir`), removed afterwards."""
    copy = fresh_upload_dir(url)
    try:
        yield copy
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)
