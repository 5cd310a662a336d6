"""`milo build` on torchrun (gloo, CPU): the same blocks, index and text as one process (chunk names aside), resumable after a killed
rank, and refused before encoding when the ranks' input cannot work; batched encoding equals
one-block encoding.

Every multi-process build runs ``python -m torch.distributed.run --standalone --nproc-per-node 2``
as a subprocess, with one torch thread per process on both sides of a comparison.
"""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from milo_infer.building.encoding import encode_blocks
from milo_infer.tasks.corpus import DEMO_CORPUS
from milo_infer.models import ModelUnavailable, default_gguf_path
from milo_store import MiloStore, NotAStoreError
from milo_store.writer import StoreLock

from milo_store.synthetic import store_contents
from tests.infer.building.test_build import tiny_model_dir, tokenizer, write_corpus  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[3]
# 6 blocks of 2 demonstrations, each encoded after one previous block: a few seconds per process.
SMALL_BUILD = ["--corpus", str(DEMO_CORPUS), "--shots", "12", "--block-size", "2", "--context-blocks", "1",
               "--threads", "1", "--json"]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def torchrun(*args, script: Path | None = None) -> list[str]:
    """The command line of a 2-process standalone torchrun of ``milo build`` (or of ``script``)."""
    target = [str(script)] if script else ["-m", "milo_infer.cli.main", "build"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *target, *map(str, args)]


def one_process(*args) -> list[str]:
    return [sys.executable, "-m", "milo_infer.cli.main", "build", *map(str, args)]


def run(cmd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run_build(cmd, out: Path) -> subprocess.CompletedProcess:
    """``run``, once more into a fresh folder if a worker died of a C++ abort: seen once in ~30 two-process
    builds here ("terminate called without an active exception", SIGABRT in rank 1), not reproduced since
    `World.close` waits for every rank before leaving the group; the retry keeps CI from failing on it
    while it is watched (docs/design.md). Any other failure, and every assertion after, stands."""
    done = run([*cmd, "--out", out])
    if done.returncode != 0 and "terminate called without an active exception" in done.stderr:
        warnings.warn("a torchrun worker aborted at exit; retrying the build once")
        done = run([*cmd, "--out", out.with_name(out.name + "-retry")])
        done.out = out.with_name(out.name + "-retry")
    else:
        done.out = out
    return done


def summary(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # only rank 0 prints


def worker_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker with ``RANK=rank`` (a child of the torchrun process)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent:
                continue
            if f"RANK={rank}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


@pytest.fixture(scope="module")
def default_model_available():
    try:
        default_gguf_path()
    except ModelUnavailable as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="module")
def one_process_store(default_model_available, tmp_path_factory):
    """The reference: the same build in one process, one torch thread."""
    out = tmp_path_factory.mktemp("single") / "store"
    s = summary(run(one_process(*SMALL_BUILD, "--out", out)))
    assert s["blocks"] == 6 and s["processes"] == 1
    return out


@pytest.mark.slow
def test_two_processes_build_the_same_bytes_as_one(one_process_store, tmp_path):
    done = run_build(torchrun(*SMALL_BUILD), tmp_path / "store")
    out, s = done.out, summary(done)
    assert s["processes"] == 2 and [r["rank"] for r in s["ranks"]] == [0, 1]
    assert [r["blocks"] for r in s["ranks"]] == [3, 3] and sum(r["tokens"] for r in s["ranks"]) == s["tokens"]
    assert not Path(f"{out}.staging").exists()
    assert store_contents(out) == store_contents(one_process_store)  # blocks, index, text, attributes


@pytest.mark.slow
def test_a_killed_rank_resumes_to_the_same_bytes(one_process_store, tmp_path):
    out = tmp_path / "store"
    staging = Path(f"{out}.staging")
    job = subprocess.Popen(torchrun(*SMALL_BUILD, "--out", out), env=environment(), cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(staging.glob("block_*.safetensors")) and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = worker_pid(job.pid, rank=1)
        assert victim is not None, "no rank 1 worker found"
        os.kill(victim, signal.SIGKILL)  # mid-build: at least one block staged, the commit far off
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode != 0, err[-2000:]
    with pytest.raises(NotAStoreError):  # nothing mounts before rank 0 commits
        MiloStore.open(out)
    staged = len(list(staging.glob("block_*.safetensors")))
    assert 0 < staged < 6

    s = summary(run(torchrun(*SMALL_BUILD, "--out", out)))
    assert s["blocks_encoded_now"] == 6 - staged
    assert store_contents(out) == store_contents(one_process_store)


LAUNCHER = """import os, sys
from milo_infer.cli.main import main
rank = int(os.environ["RANK"])
sys.exit(main(["build", *sys.argv[1:], *{extra}]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("shots, per_rank, locked, message", [
    (8, '(["--ratio", "0.6"] if rank else [])', False,
     "ranks disagree on the build's arguments: rank 1 has ratio=0.6, rank 0 has ratio=0.5"),
    (8, '(["--staging", sys.argv[sys.argv.index("--out") + 1] + ".elsewhere"] if rank else [])', False,
     "rank 1 on {host} does not see rank 0's files there; put it on storage every rank shares (--staging)"),
    (2, "[]", False, "2 processes for 1 blocks in 1 encoding batch(es) of --encode-batch 1: use at most 1 processes"),
    (8, "[]", True, "another writer is building this store"),  # a build into this store is running
])
def test_bad_distributed_input_is_refused_on_every_rank_before_encoding(tiny_model_dir, tmp_path, shots, per_rank,
                                                                        locked, message):
    corpus = write_corpus(tmp_path / "c.jsonl", 8)
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(extra=per_rank))
    out = tmp_path / "store"
    with StoreLock(out) if locked else contextlib.nullcontext():
        done = run(torchrun("--corpus", corpus, "--model", tiny_model_dir, "--shots", shots, "--block-size", 2,
                            "--threads", 1, "--out", out, script=launcher), timeout=120)
    assert done.returncode != 0
    # one error from each rank, naming the problem (counted, not split in lines: both ranks write to one pipe)
    assert done.stderr.count("milo build: ") == 2, done.stderr[-3000:]
    assert done.stderr.count(message.format(host=socket.gethostname())) == 2, done.stderr[-3000:]
    assert not list(tmp_path.glob("store*/block_*"))  # nothing was encoded
    assert not out.exists()


@pytest.mark.slow
def test_batched_encoding_equals_one_block_at_a_time(default_model):
    """Right-padded rows of different lengths give each row's K/V as its own forward pass does.

    Not bit for bit: a batch runs other matrix shapes, so fp32 rounding differs (measured: at most
    1.7e-5 on keys of magnitude ~8 by layer 17, 2e-6 relative); a wrong mask or position would be
    off by O(1). Hence 1e-5 absolute plus 1e-5 relative.
    """
    tok = default_model.tokenizer
    texts = ["Classify the intent.\nmy card was declined at the shop", "how do I top up", "where is my transfer " * 6]
    rows = [(tok(t).input_ids, captured) for t, captured in zip(texts, (5, 3, 20))]
    batched = encode_blocks(default_model.model, rows)
    for row, (keys, values, _) in zip(rows, batched):
        (k1, v1, _), = encode_blocks(default_model.model, [row])
        assert keys.shape == k1.shape == (30, 3, row[1], 64)
        torch.testing.assert_close(keys, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, v1, atol=1e-5, rtol=1e-5)


def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    """torchrun --nproc-per-node 2 on a one-GPU machine: rank 1 says what to do, not 'invalid device ordinal'."""
    from milo_infer.building.distributed import RankError, World

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RankError, match=r"only 1 GPU\(s\).*--nproc-per-node"):
        World.from_env()
