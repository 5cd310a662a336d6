"""Fetch into .whl/ the wheels the GPU machine's image lacks for tools/gpu_bench.sh (it has no internet).

The packages milo's runtime, `milo serve` and tools/bench_serve.py import, with what they require (markers
evaluated for the image's Python 3.12 on Linux), at the versions this venv runs, less what the image already
holds (`IMAGE`: the device's package list, /work/.library/device/KINDS.md, 2026-11-17). Each is
downloaded alone (``--no-deps``) as a CPython 3.12 manylinux or pure wheel. Run where pip reaches a registry:

    .venv/bin/python tools/gpu_wheels.py          # then carry .whl; gpu_bench.sh installs it into /tmp/site
    .venv/bin/python tools/gpu_wheels.py --list   # only print what it would fetch
"""
import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOTS = ["zarr", "numcodecs", "obstore", "google-crc32c", "fastapi", "uvicorn", "openai",
         "typing-extensions", "anyio"]  # the last two are in the image, maybe older than pydantic and fastapi need
IMAGE = set("""accelerate aiohttp annotated-doc attrs certifi charset-normalizer click filelock fsspec h11
hf-xet httpcore httpx huggingface-hub idna jinja2 markupsafe mpmath msgpack networkx numpy packaging pillow pip
prometheus-client psutil pygments pyyaml regex requests rich safetensors setuptools six sympy tokenizers torch
tqdm transformers triton urllib3 uvloop wheel""".split())
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
               "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed() -> dict[str, str]:
    """Distribution -> version, the closure of ROOTS outside the image."""
    found, todo = {}, list(ROOTS)
    there = IMAGE - {canonical(name) for name in ROOTS}  # a root is carried even where the image has a version
    while todo:
        name = canonical(todo.pop())
        if name in found or name in there:
            continue
        found[name] = metadata.version(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(ENVIRONMENT):
                todo.append(requirement.name)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the wheels it would fetch and fetch nothing")
    args = ap.parse_args()
    wanted = needed()
    if args.list:
        print("\n".join(f"{name}=={version}" for name, version in sorted(wanted.items())))
        return 0
    out = Path(__file__).resolve().parents[1] / ".whl"
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in sorted(wanted.items()):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(out),
                        f"{name}=={version}"], check=True)
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{len(wanted)} wheels in {out} ({size / 2**20:.1f} MiB): {', '.join(sorted(wanted))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
