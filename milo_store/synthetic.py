"""Synthetic K/V with a decaying spectrum, for tests, benchmarks and hardware runs without a model.

Real pre-RoPE keys are strongly low-rank and values less so; the decay rates mimic that, so a
synthetic store exercises the allocator and the byte layout the way a real one does.
"""
import json
import shutil
from pathlib import Path

import torch

from .codec import factorize_block
from .compress import CompressionConfig, staging_codec, write_store
from .layout import Layout
from .staging import Staging
from .store import MiloStore
from .urls import local_sidecar
from .writer import StoreLock


def synthetic_block_kv(layout: Layout, tokens: int, generator: torch.Generator,
                       key_decay: float = 0.15, value_decay: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, H, T, d] in fp32 with singular values ~ exp(-decay * j) and a per-head random scale."""
    L, H, d = layout.num_layers, layout.num_kv_heads, layout.head_dim

    def one(decay):
        n = min(tokens, d)
        u = torch.linalg.qr(torch.randn(L, H, tokens, n, generator=generator))[0]
        v = torch.linalg.qr(torch.randn(L, H, d, n, generator=generator))[0]
        scale = torch.rand(L, H, 1, generator=generator) * 4 + 1
        s = scale * torch.exp(-decay * torch.arange(n)) * tokens ** 0.5
        return (u * s.unsqueeze(-2)) @ v.transpose(-1, -2)

    return one(key_decay), one(value_decay)


def build_synthetic_store(path, layout: Layout, block_tokens, config: CompressionConfig | None = None, *,
                          seed: int = 0, force: bool = False, staging_dir=None, anchor_tokens: int = 4,
                          texts=None, example_block=None):
    """A complete store over synthetic blocks, through the real build path.

    Demonstrations: ``texts`` with ``example_block`` (the block of each), or one fake text per block.
    """
    config = config or CompressionConfig()
    g = torch.Generator().manual_seed(seed)
    staging = Staging(staging_dir or local_sidecar(path, "staging"), {"synthetic": seed, "tokens": list(map(int, block_tokens)),
                                                                  "layout": str(layout), "codec": staging_codec(config.codec)})
    for i, t in enumerate(block_tokens):
        if not staging.has(i):
            staging.put(i, factorize_block(*synthetic_block_kv(layout, int(t), g), codec=staging_codec(config.codec)))
    anchor = torch.randn(layout.num_layers, 2, layout.num_kv_heads, anchor_tokens, layout.head_dim, generator=g)
    n = len(block_tokens)
    examples = {"input": [f"synthetic demonstration {i}" for i in range(n)], "block": list(range(n)),
                "tokens": list(map(int, block_tokens))}  # one demonstration per block (what example-svd needs)
    if texts is not None:
        examples = {"input": list(texts), "block": list(example_block)}
    m = len(examples["input"])
    examples.update(output=["x"] * m, id=[str(i) for i in range(m)])
    out = write_store(path, staging, n, layout, config, attrs={"model": {"name": "synthetic"}},
                      anchor_kv=anchor, examples=examples, force=force)
    staging.remove()
    return out


def update_synthetic_store(path, keep, new_tokens, config: CompressionConfig | None = None, *, seed: int = 0,
                           block_cache=None):
    """A new version of the synthetic store at ``path`` through the real update path (`write_store` with
    ``previous``): its blocks ``keep``, in that order and byte for byte, then new synthetic blocks of
    ``new_tokens`` tokens, each with one demonstration of its own. As a real update, it holds the
    writer lock before it reads the store, and keeps it to the commit."""
    config = config or CompressionConfig()
    with StoreLock(path) as lock, MiloStore.open(path, tier="disk", block_cache=block_cache) as previous:
        old = previous.examples()
        layout = Layout(previous.layout.num_layers, previous.layout.num_kv_heads, previous.layout.head_dim)
        g = torch.Generator().manual_seed(seed)
        staging = Staging(local_sidecar(path, "staging"), {"synthetic-update": seed, "keep": list(keep),
                                                           "tokens": list(map(int, new_tokens)), "layout": str(layout)})
        for k, t in enumerate(new_tokens):
            staging.put(len(keep) + k, factorize_block(*synthetic_block_kv(layout, int(t), g),
                                                       codec=staging_codec(config.codec)))
        examples = {"input": [], "output": [], "id": [], "block": []}
        for i, b in enumerate(keep):  # the kept blocks' demonstrations, in their new block order
            for e in (e for e, block in enumerate(old["block"]) if block == b):
                for name in ("input", "output", "id"):
                    examples[name].append(old[name][e])
                examples["block"].append(i)
        for k in range(len(new_tokens)):
            examples["input"].append(f"synthetic demonstration added {seed} {k}")
            examples["output"].append("x")
            examples["id"].append(f"added-{seed}-{k}")
            examples["block"].append(len(keep) + k)
        out = write_store(path, staging, len(keep) + len(new_tokens), layout, config, attrs={"model": {"name": "synthetic"}},
                          anchor_kv=previous.anchor_kv(), examples=examples, previous=previous, lock=lock,
                          reused={i: b for i, b in enumerate(keep)})
        staging.remove()
    return out


def store_arrays(store_dir) -> list[str]:
    """Every array of a store directory, as its path inside the store ('examples/input', 'indexes/bm25/terms', ...)."""
    store_dir = Path(store_dir)
    return sorted(str(p.parent.relative_to(store_dir)) for p in store_dir.rglob("zarr.json")
                  if json.loads(p.read_text())["node_type"] == "array")


def flipped_copy(store_dir, array: str, dest) -> Path:
    """A copy of the store at ``dest`` with one bit flipped in the middle of ``array``'s first chunk file:
    what corruption tests feed to readers that must detect it."""
    dest = Path(dest)
    shutil.copytree(store_dir, dest)
    chunk = sorted(p for p in (dest / array / "c").rglob("*") if p.is_file())[0]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))
    return dest
