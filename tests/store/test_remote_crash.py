"""SIGKILL a writer to an S3 URL mid-upload (before the manifest): the previous version stays readable,
no partial version mounts, a rerun completes, and gc leaves only referenced objects."""
import os
import signal
import subprocess
import sys
import time

import obstore
import pytest
import torch

from milo_store import MiloStore, NotAStoreError
from milo_store.blockcache import BlockCache
from milo_store.remote import gc, version_chunks
from milo_store.synthetic import build_synthetic_store
from milo_store.urls import open_object_store

from .conftest import LAYOUT, TOKENS
from .test_remote import CONFIG, _manifest, _versions

# Uploads a few objects of the new version, then waits to be killed before the manifest is written.
WRITER = r"""
import sys, time
import obstore
import milo_store.remote as remote
from milo_store import CompressionConfig
from milo_store.synthetic import build_synthetic_store
from tests.store.conftest import LAYOUT, TOKENS
real_put, uploaded = obstore.put, [0]
def put(store, path, *a, **k):
    if path.startswith("v/"):
        uploaded[0] += 1
        if uploaded[0] == 4:
            print("READY", flush=True)
            time.sleep(60)
    return real_put(store, path, *a, **k)
remote.obstore.put = put
remote.UPLOAD_CONCURRENCY = 1
build_synthetic_store(sys.argv[1], LAYOUT, TOKENS, CompressionConfig(ratio=0.5), seed=int(sys.argv[2]),
                      force=sys.argv[3] == "force")
"""


def _kill_mid_upload(url: str, seed: int, force: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, str(seed), "force" if force else "create"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.time() + 60
    while time.time() < deadline and proc.stdout.readline().strip() != "READY":
        assert proc.poll() is None, "the writer exited before uploading"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_writer_killed_mid_upload_leaves_the_previous_version(tmp_path, s3_url):
    _kill_mid_upload(s3_url, seed=1, force=False)
    assert len(_versions(s3_url)) == 1  # a partial version is there...
    with pytest.raises(NotAStoreError):  # ...and nothing mounts
        MiloStore.open(s3_url)
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)  # the rerun completes
    first = _manifest(s3_url)["version"]
    with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as s:
        before = [s.block(i).clone() for i in range(s.num_blocks)]

    _kill_mid_upload(s3_url, seed=2, force=True)  # killed during a --force replace
    assert _manifest(s3_url)["version"] == first
    with MiloStore.open(s3_url, tier="disk", block_cache=BlockCache(tmp_path / "c2")) as s:
        assert s.verify_all() == [] and all(torch.equal(a, s.block(i)) for i, a in enumerate(before))

    report = gc(s3_url, older_than=0)
    assert len(report["removed_versions"]) == 2  # the two partial uploads
    assert _versions(s3_url) == [first]
    keys = [o["path"] for batch in obstore.list(open_object_store(s3_url)) for o in batch]
    referenced = {f"chunks/{c}" for c in version_chunks(open_object_store(s3_url), s3_url, first)}
    assert all(k == "manifest.json" or k.startswith(f"v/{first}/") or k in referenced for k in keys)
    assert referenced <= set(keys)
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=2, force=True)
    assert _manifest(s3_url)["previous"] == first
