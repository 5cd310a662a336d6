"""The processes of a build: one alone, or the ranks torchrun started (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` in the environment), joined in a torch.distributed group (nccl on CUDA, gloo on CPU).

A build's steps run on every rank at the same point, and a step that fails on one rank must fail on
all of them (else the others wait in the next collective until its timeout): `World.step` gathers
every rank's outcome and raises the first failure everywhere (`RankError` on the ranks that did not
fail themselves). Encoding is the exception: a rank that fails there exits, and torchrun stops the
others and names it (or restarts them all with ``--max-restarts``).
"""
import os
import socket
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# How long a rank waits in a collective: the others may be encoding their last block, or rank 0
# allocating and writing a large store.
COLLECTIVE_TIMEOUT = timedelta(hours=2)


class RankError(ValueError):
    """Another rank failed this step; the message is its error."""


class World:
    """This process's rank among ``size``, the device it encodes on, and the collectives a build needs."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0, device: torch.device | None = None):
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.device = device or torch.device("cpu")

    @classmethod
    def from_env(cls) -> "World":
        """Join torchrun's group when ``WORLD_SIZE`` > 1; encode on ``cuda:LOCAL_RANK`` where CUDA is, else the CPU."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cpu")
        if torch.cuda.is_available():
            if local_rank >= torch.cuda.device_count():
                raise RankError(f"process {local_rank} on this machine but only {torch.cuda.device_count()} GPU(s): "
                                f"start at most that many (--nproc-per-node), or build on the CPU with "
                                f"CUDA_VISIBLE_DEVICES= set")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        if size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT,
                                    device_id=device if device.type == "cuda" else None)
        return cls(rank, size, local_rank, device)

    @property
    def host(self) -> str:
        return socket.gethostname()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        objs = [None] * self.size
        dist.all_gather_object(objs, obj)
        return objs

    def step(self) -> "_Step":
        """``with world.step(): ...`` on every rank: if the body fails anywhere, it fails everywhere."""
        return _Step(self)

    def agree(self, fingerprint: dict) -> None:
        """Refuse to start when ranks were given different arguments (``fingerprint``: what must match)."""
        everyone = self.gather(fingerprint)
        first = everyone[0]
        for rank, other in enumerate(everyone):
            keys = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
            if keys:
                k = keys[0]
                more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
                raise RankError(f"ranks disagree on the build's arguments: rank {rank} has {k}={other.get(k)!r}, "
                                f"rank 0 has {k}={first.get(k)!r}{more}")

    def check_shared(self, directory: Path) -> None:
        """Every rank can write ``directory`` and sees what rank 0 wrote there (storage all ranks share)."""
        if self.size == 1:
            return
        token = self.gather(uuid.uuid4().hex)[0]
        mark = directory / ".rank0.tmp"  # .tmp: a staging directory drops these when opened
        with self.step():
            if self.rank == 0:
                mark.write_text(token)
        with self.step():
            if self.rank != 0:
                try:
                    seen = mark.read_text()
                except OSError:
                    seen = None
                if seen != token:
                    raise RankError(f"staging directory {directory}: rank {self.rank} on {self.host} does not see "
                                    "rank 0's files there; put it on storage every rank shares (--staging)")
                probe = directory / f".rank{self.rank}.tmp"
                try:
                    probe.write_text(token)
                    probe.unlink()
                except OSError as e:
                    raise RankError(f"staging directory {directory} is not writable from rank {self.rank} "
                                    f"on {self.host}: {e.strerror or e}") from None
        with self.step():
            if self.rank == 0:
                mark.unlink()

    def close(self, finished: bool = False) -> None:
        """Leave the group. After a build that finished on every rank, first wait for all of them, so no
        rank tears its connections down while another still talks to it (a gloo process that exits
        under a peer's pending collective can abort at interpreter exit). After a failure, never wait:
        the other ranks may be gone."""
        if self.size > 1 and dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


class _Step:
    def __init__(self, world: World):
        self.world = world

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not issubclass(exc_type, Exception):
            return False  # Ctrl-C, SystemExit: leave at once; torchrun stops the others
        outcomes = self.world.gather(None if exc is None else str(exc) or exc_type.__name__)
        if exc is not None:
            return False  # our own error, raised as it is
        failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
        if failed:
            rank, message = failed[0]
            raise RankError(f"rank {rank} failed: {message}")
        return False
