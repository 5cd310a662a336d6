"""SIGKILL a writer at several points: the path never opens as a valid store, and a new build succeeds."""
import os
import signal
import subprocess
import sys
import time

import pytest

from milo_store import CompressionConfig, Layout, MiloStore, StoreError
from milo_store.synthetic import build_synthetic_store

WRITER = r"""
import sys, time
import milo_store.writer as w
from milo_store import CompressionConfig, Layout
from milo_store.synthetic import build_synthetic_store
point = sys.argv[2]
hooks = {"block": ("write_block", 1), "commit": ("commit", 0)}
if point in hooks:
    name, after = hooks[point]
    original = getattr(w.StoreWriter, name)
    calls = [0]
    def slow(self, *a, **k):
        calls[0] += 1
        if calls[0] > after:
            print("READY", flush=True)
            time.sleep(60)
        return original(self, *a, **k)
    setattr(w.StoreWriter, name, slow)
if point == "rename":
    import os
    real = os.rename
    def slow_rename(a, b):
        print("READY", flush=True)
        time.sleep(60)
        real(a, b)
    w.os.rename = slow_rename
print("READY" if point == "start" else "", flush=True)
build_synthetic_store(sys.argv[1], Layout(2, 1, 16), [30, 20, 25], CompressionConfig(ratio=0.5))
"""


@pytest.mark.parametrize("point", ["start", "block", "commit", "rename"])
def test_killed_writer_never_leaves_a_valid_store(tmp_path, point):
    path = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), point], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.stdout.readline().strip() == "READY":
            break
    time.sleep(0.2 if point == "start" else 0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if path.exists():  # "start" may have finished before the kill; a finished store must then be whole
        assert point == "start"
        assert MiloStore.open(path).verify_all() == []
    else:
        with pytest.raises(StoreError):
            MiloStore.open(path)
    build_synthetic_store(path, Layout(2, 1, 16), [30, 20, 25], CompressionConfig(ratio=0.5), force=True)
    with MiloStore.open(path) as store:
        assert store.num_blocks == 3 and store.verify_all() == []
    assert not list(tmp_path.glob("store.tmp-*")), "stale temporary directories are cleaned by the next writer"
