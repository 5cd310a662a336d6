"""Per-block factors kept at full rank on disk between the two passes of a build.

Allocation must see every block's spectrum before any rank is fixed; holding all full-rank KV in
memory would not scale. Pass one factors each block and stages it here (one safetensors file per
block, written under a temporary name and renamed, so a killed build leaves only whole files); pass
two reads them back, truncates to the allocated ranks and writes the store. A build restarted with
the same fingerprint (its arguments) resumes from the staged blocks; another fingerprint starts over.
"""
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .codec import BlockFactors

FINGERPRINT = "fingerprint.json"


class Staging:
    def __init__(self, directory, fingerprint: dict):
        self.dir = Path(directory)
        fp = json.dumps(fingerprint, sort_keys=True)
        fp_path = self.dir / FINGERPRINT
        if self.dir.exists() and (not fp_path.is_file() or fp_path.read_text() != fp):
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not fp_path.is_file():
            tmp = fp_path.with_suffix(".tmp")
            tmp.write_text(fp)
            os.replace(tmp, fp_path)

    def _file(self, i: int) -> Path:
        return self.dir / f"block_{i:06d}.safetensors"

    def has(self, i: int) -> bool:
        return self._file(i).is_file()

    def put(self, i: int, factors: BlockFactors) -> None:
        tmp = self.dir / f".block_{i:06d}.tmp"
        save_file({"A": factors.A.contiguous(), "S": factors.S.contiguous(), "B": factors.B.contiguous()}, str(tmp))
        os.replace(tmp, self._file(i))

    def get(self, i: int) -> BlockFactors:
        t = load_file(str(self._file(i)))
        return BlockFactors(A=t["A"], S=t["S"], B=t["B"])

    def spectrum(self, i: int) -> tuple[int, torch.Tensor]:
        """(tokens, singular values) of block i, without loading its A and B (allocation needs only these)."""
        with safe_open(str(self._file(i)), framework="pt") as f:
            return f.get_slice("A").get_shape()[-2], f.get_tensor("S")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
