"""SIGKILL an update at several points: the previous version keeps mounting and answering, byte for byte;
a rerun completes, and what the killed writer left is cleared (a directory) or collected (a URL)."""
import os
import signal
import subprocess
import sys
import time

import obstore
import pytest
import torch

from milo_store import MiloStore
from milo_store.blockcache import BlockCache
from milo_store.remote import gc, version_chunks
from milo_store.synthetic import build_synthetic_store, update_synthetic_store
from milo_store.urls import open_object_store

from .conftest import LAYOUT, TOKENS
from .test_remote import CONFIG, _manifest, _versions

# Runs an update (blocks 0, 1 and 3 kept, two new), stopping to be killed at the point named.
UPDATER = r"""
import shutil, sys, time
import obstore
import milo_store.format as fmt, milo_store.remote as remote, milo_store.writer as w
from milo_store import CompressionConfig
from milo_store.synthetic import update_synthetic_store

def stop_at(owner, name, after=0, done=False):
    original, calls = getattr(owner, name), [0]
    def stopped(*a, **k):
        calls[0] += 1
        result = original(*a, **k) if done else None
        if calls[0] > after:
            print("READY", flush=True)
            time.sleep(60)
        return result if done else original(*a, **k)
    setattr(owner, name, stopped)

fmt.MAX_CHUNK_BYTES = 512
remote.UPLOAD_CONCURRENCY = 1
point = sys.argv[2]
if point == "block":
    stop_at(w.StoreWriter, "write_block", after=1)
elif point == "commit":
    stop_at(w.StoreWriter, "commit")
elif point == "link":
    stop_at(w, "_link_or_copy", after=1)
elif point == "exchange":
    stop_at(w, "_exchange")
elif point == "replaced":  # the exchange done, the old store not yet removed
    stop_at(w, "_exchange", done=True)
elif point == "chunks":  # some of the new chunks uploaded, nothing of the version
    stop_at(remote.obstore, "put", after=1)
elif point == "version":  # every chunk and part of the version uploaded
    real_put, puts = remote.obstore.put, []
    def put(store, key, *a, **k):
        puts.append(key)
        if sum(p.startswith("v/") for p in puts) > 2:
            print("READY", flush=True)
            time.sleep(60)
        return real_put(store, key, *a, **k)
    remote.obstore.put = put
update_synthetic_store(sys.argv[1], [0, 1, 3], [25, 14], CompressionConfig(ratio=0.5), seed=9)
"""


def kill_update(location, point: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", UPDATER, str(location), point], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.time() + 120
    while time.time() < deadline and proc.stdout.readline().strip() != "READY":
        assert proc.poll() is None, f"the update exited before reaching {point}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def answers(location, cache) -> tuple:
    """What a reader gets: every block's bytes and the demonstrations, from a verified mount."""
    with MiloStore.open(location, tier="disk", block_cache=BlockCache(cache)) as s:
        assert s.verify_all() == []
        return [s.block(i).clone() for i in range(s.num_blocks)], s.examples()


def same(a, b) -> bool:
    return len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1]


@pytest.mark.parametrize("point", ["block", "commit", "link", "exchange", "replaced"])
def test_a_killed_update_of_a_directory_leaves_the_previous_version(tmp_path, monkeypatch, point):
    monkeypatch.setattr("milo_store.format.MAX_CHUNK_BYTES", 512)  # a chunk per block: some kept, linked
    path = build_synthetic_store(tmp_path / "store", LAYOUT, TOKENS, CONFIG, seed=1)
    before = answers(path, tmp_path / "c")
    kill_update(path, point)
    after = answers(path, tmp_path / "c")
    if point == "replaced":  # killed after the atomic exchange: the update is done, its tmp holds the old store
        assert len(after[0]) == 5 and all(torch.equal(after[0][i], before[0][b]) for i, b in enumerate((0, 1, 3)))
        assert list(tmp_path.glob("store.tmp-*"))
        update_synthetic_store(path, [0, 1, 2, 3], [], CONFIG)  # the next writer clears it
    else:
        assert same(after, before)
        update_synthetic_store(path, [0, 1, 3], [25, 14], CONFIG, seed=9)  # the rerun completes
        done = answers(path, tmp_path / "c")
        assert len(done[0]) == 5 and all(torch.equal(done[0][i], before[0][b]) for i, b in enumerate((0, 1, 3)))
    assert not list(tmp_path.glob("store.tmp-*")) and not list(tmp_path.glob("store.old-*"))


@pytest.mark.parametrize("point", ["chunks", "version"])
def test_a_killed_update_of_a_url_leaves_the_previous_version(tmp_path, s3_url, monkeypatch, point):
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("milo_store.format.MAX_CHUNK_BYTES", 512)
    build_synthetic_store(s3_url, LAYOUT, TOKENS, CONFIG, seed=1)
    first = _manifest(s3_url)["version"]
    before = answers(s3_url, tmp_path / "c1")
    kill_update(s3_url, point)
    partial = 1 if point == "version" else 0  # a partial version, unnamed; or only chunks no version names
    assert _manifest(s3_url)["version"] == first and len(_versions(s3_url)) == 1 + partial
    assert same(answers(s3_url, tmp_path / "c2"), before)
    update_synthetic_store(s3_url, [0, 1, 3], [25, 14], CONFIG, seed=9)
    assert _manifest(s3_url)["previous"] == first
    report = gc(s3_url, older_than=0)
    assert len(report["removed_versions"]) == partial and report["removed_chunks"] >= 1  # the killed one's uploads
    assert sorted(_versions(s3_url)) == sorted([first, _manifest(s3_url)["version"]])
    store = open_object_store(s3_url)
    referenced = set().union(*(version_chunks(store, s3_url, v) for v in _versions(s3_url)))
    keys = [o["path"] for batch in obstore.list(store) for o in batch]
    assert all(k == "manifest.json" or k.split("/")[1] in _versions(s3_url) or k.split("/")[1] in referenced
               for k in keys)
