"""Synthetic K/V with a decaying spectrum, for tests, benchmarks and hardware runs without a model.

Real pre-RoPE keys are strongly low-rank and values less so; the decay rates mimic that, so a
synthetic store exercises the allocator and the byte layout the way a real one does.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from . import format as fmt
from .codecs import CompressionConfig, factorize_block, staging_codec
from .compress import write_store
from .layout import Layout
from .staging import Staging
from .store import MiloStore
from .urls import local_sidecar
from .writer import StoreLock
from . import BlockFactors  # the package's export: where it lives moves (issue 57)


def spectral_draws(layout: Layout, tokens: int, generator: torch.Generator, key_decay: float = 0.15,
                   value_decay: float = 0.05):
    """For K then V: (U [L, H, T, n], s [L, H, n], V [L, H, d, n]), n = min(T, d), U and V with orthonormal
    columns and s decreasing (~ exp(-decay * j), a per-head random scale), on the generator's device: the
    singular triplets of the block `synthetic_block_kv` returns."""
    L, H, d = layout.num_layers, layout.num_kv_heads, layout.head_dim
    on = {"generator": generator, "device": generator.device}

    def one(decay, width=d):
        n = min(tokens, width)
        u = torch.linalg.qr(torch.randn(L, H, tokens, n, **on))[0]
        v = torch.linalg.qr(torch.randn(L, H, width, n, **on))[0]
        scale = torch.rand(L, H, 1, **on) * 4 + 1
        return u, scale * torch.exp(-decay * torch.arange(n, device=generator.device)) * tokens ** 0.5, v

    def on_layout(kind, decay):
        """A layout whose layers differ: each width's units drawn at that width, zero where a layer stores none."""
        n = min(tokens, d)
        u, s, v = (torch.zeros(L, H, *shape, device=generator.device) for shape in ((tokens, n), (n,), (d, n)))
        widths = layout.widths[:, kind, 0]
        for width in sorted(set(widths[layout.present[:, kind].any(1)].tolist())):
            units = torch.from_numpy(layout.present[:, kind] & (widths == width)[:, None]).to(generator.device)
            uw, sw, vw = one(decay, width)
            r = sw.shape[-1]
            u[units, :, :r], s[units, :r], v[units, :width, :r] = uw[units], sw[units], vw[units]
        return u, s, v

    if layout.uniform:
        return one(key_decay), one(value_decay)
    return on_layout(0, key_decay), on_layout(1, value_decay)


def synthetic_block_kv(layout: Layout, tokens: int, generator: torch.Generator,
                       key_decay: float = 0.15, value_decay: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, H, T, d] in fp32 with singular values ~ exp(-decay * j) and a per-head random scale (on the
    generator's device)."""
    return tuple((u * s.unsqueeze(-2)) @ v.transpose(-1, -2)
                 for u, s, v in spectral_draws(layout, tokens, generator, key_decay, value_decay))


def synthetic_block_factors(layout: Layout, tokens: int, generator: torch.Generator
                            ) -> tuple[BlockFactors, torch.Tensor, torch.Tensor]:
    """A synthetic block's SVD factors, known from its draw (no SVD to run: U diag(s) Vᵀ with orthonormal U, V
    and s decreasing is its own SVD, up to each column's sign), and its K, V: the same draws, in the same
    order, as `synthetic_block_kv`, so one generator gives the same K/V either way. What a benchmark builds
    many blocks of a large model's shape with, on the device."""
    (uk, sk, vk), (uv, sv, vv) = spectral_draws(layout, tokens, generator)
    k, v = ((u * s.unsqueeze(-2)) @ w.transpose(-1, -2) for u, s, w in ((uk, sk, vk), (uv, sv, vv)))
    factors = BlockFactors(A=torch.stack((uk, uv), 1), S=torch.stack((sk, sv), 1), B=torch.stack((vk, vv), 1))
    return factors, k, v


def synthetic_states(layout: Layout, generator: torch.Generator) -> dict[int, torch.Tensor]:
    """Each linear layer's state section, random fp32 values (M, C and conv tail alike: storage does not read them);
    nothing, and no draw, for a layout without linear layers."""
    return {l: torch.randn(spec.state_values, generator=generator) * 0.1
            for l, spec in enumerate(layout.layers) if spec.state_values}


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
            factors = factorize_block(*synthetic_block_kv(layout, int(t), g), codec=staging_codec(config.codec))
            factors.states = synthetic_states(layout, g)
            staging.put(i, factors)
    anchor = torch.randn(layout.num_layers, 2, layout.num_kv_heads, anchor_tokens, layout.head_dim, generator=g)
    n = len(block_tokens)
    examples = {"input": [f"synthetic demonstration {i}" for i in range(n)], "block": list(range(n)),
                "tokens": list(map(int, block_tokens))}  # one demonstration per block (what example-svd needs)
    if texts is not None:
        examples = {"input": list(texts), "block": list(example_block)}
    m = len(examples["input"])
    examples.update(output=["x"] * m, id=[str(i) for i in range(m)])
    out = write_store(path, staging, n, layout, config, attrs={"model": {"name": "synthetic"}},
                      anchor_kv=anchor, anchor_states=synthetic_states(layout, g), examples=examples, force=force)
    staging.remove()
    return out


def update_synthetic_store(path, keep, new_tokens, config: CompressionConfig | None = None, *, seed: int = 0,
                           block_cache=None, purge=None):
    """A new version of the synthetic store at ``path`` through the real update path (`write_store` with
    ``previous``): its blocks ``keep``, in that order and byte for byte, then new synthetic blocks of
    ``new_tokens`` tokens, each with one demonstration of its own. ``purge``: the previous blocks whose
    bytes must go (default: every block not kept). As a real update, it holds the writer lock before it
    reads the store, and keeps it to the commit."""
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
                          reused={i: b for i, b in enumerate(keep)}, purge=purge)
        staging.remove()
    return out


def staged_synthetic_blocks(directory, layout: Layout, tokens: list[int], seed: int = 0
                            ) -> tuple[Staging, list[torch.Tensor]]:
    """An SVD staging in ``directory`` of synthetic blocks of ``tokens`` each (`synthetic_block_kv`, one generator
    seeded ``seed``), and their exact K/V [L, 2, H, T, d]: what codec and baseline tests compress."""
    g = torch.Generator().manual_seed(seed)
    staging = Staging(directory, {"test": seed})
    xs = []
    for i, t in enumerate(tokens):
        k, v = synthetic_block_kv(layout, t, g)
        staging.put(i, factorize_block(k, v, codec="svd"))
        xs.append(torch.stack((k, v), dim=1))
    return staging, xs


def store_arrays(store_dir) -> list[str]:
    """Every array of a store directory, as its path inside the store ('examples/input', 'indexes/bm25/terms',
    ...); in a format-4 store also each factor chunk ('chunks/<id>') and each text segment's arrays
    ('segment-<k>/<name>'): everything corruption tests damage one at a time."""
    store_dir = Path(store_dir)
    names = sorted(str(p.parent.relative_to(store_dir)) for p in store_dir.rglob("zarr.json")
                   if json.loads(p.read_text())["node_type"] == "array")
    with MiloStore.open(store_dir, tier="disk", verify=False) as store:
        if store.segmented:
            texts = {store.placement.names[c] for c in store.segment_table[:, 0].tolist()}
            names += sorted(set(store.placement.names) - texts)
            names += [f"segment-{k}/{name}" for k in range(len(store.segment_table))
                      for name, entry in store.segment(k).layout.items() if entry["count"]]
    return names


def block_location(store_dir, block: int) -> tuple[Path, int]:
    """The file holding block ``block``'s bytes, and where in it they start (what corruption tests damage)."""
    with MiloStore.open(store_dir, tier="disk", verify=False) as store:
        start = int(store.offsets[block]) * store.stored_itemsize
        chunk, at, _, _ = next(iter(store.placement.pieces(start, start + 1)))
        return Path(store_dir) / store.placement.names[chunk], at


def flipped_copy(store_dir, array: str, dest) -> Path:
    """A copy of the store at ``dest`` with one bit flipped in the middle of ``array`` (`store_arrays`' names:
    an array's first chunk file, a chunk file, or a text segment's array): what corruption tests feed to
    readers that must detect it."""
    dest = Path(dest)
    shutil.copytree(store_dir, dest)
    if array.startswith("segment-"):
        k, name = array.removeprefix("segment-").split("/")
        with MiloStore.open(dest, tier="disk", verify=False) as store:
            seg = store.segment(int(k))
            entry = seg.layout[name]
            chunk = dest / store.placement.names[int(store.segment_table[int(k), 0])]
            at = seg.base + entry["offset"] + entry["count"] * np.dtype(entry["dtype"]).itemsize // 2
    else:
        chunk = dest / array if (dest / array).is_file() else sorted(p for p in (dest / array / "c").rglob("*")
                                                                       if p.is_file())[0]
        at = chunk.stat().st_size // 2
    raw = bytearray(chunk.read_bytes())
    raw[at] ^= 0x10
    chunk.write_bytes(bytes(raw))
    return dest


LAYOUT_ARRAYS = (fmt.CHUNK_IDS, fmt.CHUNK_SIZES, fmt.EXTENTS, fmt.SEGMENTS)  # where bytes lie: chunk names are random


def store_contents(location) -> dict:
    """What a reader gets from a store, where its bytes lie aside (chunk names, extents, text segments): every
    block's bytes and index entries, the anchor, token ids, demonstrations, named indexes and attributes.
    What "the same store" compares across builds (a resumed, distributed or updated one against another)."""
    with MiloStore.open(location, tier="disk") as s:
        anchor = s.anchor_kv()
        checksums = {k: v for k, v in (s.meta.get(fmt.ARRAY_CHECKSUMS) or {}).items() if k not in LAYOUT_ARRAYS}
        return {
            "blocks": [s.block(i).view(torch.uint8).numpy().tobytes() for i in range(s.num_blocks)],
            "ranks": s.ranks.tolist(), "block_tokens": s.block_tokens.tolist(), "checksums": s.checksums.tolist(),
            "block_group": s.block_group.tolist() if s.grouped else None,
            "anchor": None if anchor is None else anchor.view(torch.uint8).numpy().tobytes(),
            "token_ids": [None if s.token_ids(i) is None else s.token_ids(i).tolist() for i in range(s.num_blocks)],
            "examples": s.examples(),
            "indexes": {name: ({k: v for k, v in attrs.items()}, {a: x.tolist() for a, x in arrays.items()})
                        for name in s.index_names() for attrs, arrays in [s.index_arrays(name, check=True)]},
            "attrs": {**{k: v for k, v in s.meta.items() if k != fmt.ARRAY_CHECKSUMS}, fmt.ARRAY_CHECKSUMS: checksums},
        }
