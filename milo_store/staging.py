"""Per-block factors kept at full rank on disk between the two passes of a build.

Allocation must see every block's spectrum before any rank is fixed; holding all full-rank KV in
memory would not scale. Pass one factors each block and stages it here (one safetensors file per
block, written under a temporary name, fsynced and renamed, so a killed build leaves only whole
files; each carries the CRC32C of its tensors, checked by `verify` before a resumed build reuses
it); pass two reads them back, truncates to the allocated ranks and writes the store. A build
restarted with the same fingerprint (its arguments) resumes from the staged blocks; another
fingerprint starts over. Several processes may stage into one directory (a distributed build):
one opens it (`Staging`, which may wipe it), the others `join` it once that is done.
"""
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .checksum import crc32c
from .codecs import BlockFactors

FINGERPRINT = "fingerprint.json"
TENSORS = ("A", "S", "B")
STATE = "state_"  # a linear layer's state values: state_<layer>


class StagingError(ValueError):
    """The staging directory cannot be used as asked (another build's, or not there)."""


class Staging:
    def __init__(self, directory, fingerprint: dict, *, join: bool = False):
        """Open ``directory`` for ``fingerprint``: a different (or no) fingerprint wipes it, unless
        ``join`` is set, which opens one another process created and refuses any mismatch."""
        self.dir = Path(directory)
        fp = json.dumps(fingerprint, sort_keys=True)
        fp_path = self.dir / FINGERPRINT
        matches = fp_path.is_file() and fp_path.read_text() == fp
        if join:
            if not matches:
                raise StagingError(f"staging directory {self.dir} does not hold this build's fingerprint "
                                   f"({'another build' if fp_path.is_file() else 'no fingerprint'} there)")
            return
        if self.dir.exists() and not matches:
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # what writers killed mid-file left
            stale.unlink(missing_ok=True)
        if not matches:
            tmp = fp_path.with_suffix(".tmp")
            tmp.write_text(fp)
            os.replace(tmp, fp_path)

    def _file(self, i: int) -> Path:
        return self.dir / f"block_{i:06d}.safetensors"

    def has(self, i: int) -> bool:
        return self._file(i).is_file()

    def staged(self) -> list[int]:
        """Indices of the blocks staged so far (whole files; not verified)."""
        return sorted(int(f.stem.removeprefix("block_")) for f in self.dir.glob("block_*.safetensors"))

    def put(self, i: int, factors: BlockFactors) -> None:
        tensors = {name: getattr(factors, name).detach().cpu().contiguous() for name in TENSORS}
        tensors |= {f"{STATE}{l}": t.detach().cpu().contiguous() for l, t in factors.states.items()}
        tmp = self.dir / f".block_{i:06d}.tmp"
        save_file(tensors, str(tmp), metadata={f"crc32c_{k}": str(crc32c(t)) for k, t in tensors.items()})
        fd = os.open(tmp, os.O_RDONLY)
        try:  # on disk before the name says it is whole, also after a machine crash
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._file(i))

    def get(self, i: int) -> BlockFactors:
        t = load_file(str(self._file(i)))
        states = {int(name.removeprefix(STATE)): v for name, v in t.items() if name.startswith(STATE)}
        return BlockFactors(A=t["A"], S=t["S"], B=t["B"], states=states)

    def verify(self, i: int) -> bool:
        """Whether staged block i is there, readable, and matches its checksums (a file staged
        before checksums existed counts when it loads whole: it was written atomically)."""
        try:
            with safe_open(str(self._file(i)), framework="pt") as f:
                sums = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in (*TENSORS, *(k for k in f.keys() if k.startswith(STATE)))}
        except (OSError, SafetensorError):
            return False
        return all(f"crc32c_{k}" not in sums or sums[f"crc32c_{k}"] == str(crc32c(t)) for k, t in tensors.items())

    def discard(self, i: int) -> None:
        self._file(i).unlink(missing_ok=True)

    def spectrum(self, i: int) -> tuple[int, torch.Tensor]:
        """(tokens, singular values) of block i, without loading its A and B (allocation needs only these)."""
        with safe_open(str(self._file(i)), framework="pt") as f:
            return f.get_slice("A").get_shape()[-2], f.get_tensor("S")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
