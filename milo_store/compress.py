"""Pass two of a build: allocate ranks over every staged spectrum, then write the store."""
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .allocation import allocate_ranks
from .codec import CODECS, pack_block
from .format import TORCH_DTYPES
from .layout import Layout
from .staging import Staging
from .writer import StoreWriter


@dataclass
class CompressionConfig:
    ratio: float = 0.5
    codec: str = "svd"
    policy: str = "entropy"
    scope: str = "head"
    kv_split: str = "separate"
    r_min: int = 1
    r_max: int | None = None
    eps: float = 1e-3
    seed: int = 0
    dtype: str = "float16"
    key_share: float = 0.5  # share of the budget for keys when kv_split is "separate"
    full_rank: bool = False  # keep every singular direction (the exactness reference for the codec)

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; expected one of {CODECS}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1]; got {self.ratio}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown factor dtype {self.dtype!r}; expected one of {tuple(TORCH_DTYPES)}")
        if not 0 < self.key_share < 1 or (self.key_share != 0.5 and self.kv_split != "separate"):
            raise ValueError(f"key share {self.key_share} must be in (0, 1), and needs kv_split 'separate'")


def plan_ranks(staging: Staging, num_blocks: int, layout: Layout, config: CompressionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(ranks [N, L, 2, H], tokens [N]) for the staged blocks under ``config``."""
    d = layout.head_dim
    tokens = np.zeros(num_blocks, dtype=np.int64)
    spectra = np.zeros((num_blocks, layout.num_layers, 2, layout.num_kv_heads, d))
    for i in range(num_blocks):
        f = staging.get(i)
        tokens[i] = f.tokens
        s = f.S.double().numpy()
        spectra[i, ..., :s.shape[-1]] = s
    if config.codec == "identity":
        return np.full(spectra.shape[:4], d, dtype=np.int16), tokens
    if config.full_rank:
        full = np.minimum(tokens, d).reshape(-1, 1, 1, 1)
        return np.broadcast_to(full, spectra.shape[:4]).astype(np.int16), tokens
    itemsize = torch.empty(0, dtype=TORCH_DTYPES[config.dtype]).element_size()
    ranks = allocate_ranks(spectra, tokens, layout, config.ratio, policy=config.policy, scope=config.scope,
                           kv_split=config.kv_split, r_min=config.r_min, r_max=config.r_max, eps=config.eps,
                           seed=config.seed, bytes_per_value=itemsize, key_share=config.key_share)
    return ranks, tokens


def write_store(path, staging: Staging, num_blocks: int, layout: Layout, config: CompressionConfig, *,
                attrs: dict | None = None, anchor_kv: torch.Tensor | None = None, examples: dict | None = None,
                token_ids: np.ndarray | None = None, force: bool = False, lock=None, progress: Callable[[int], None] | None = None) -> Path:
    """Allocate and commit the store at ``path`` from ``num_blocks`` staged blocks."""
    layout = replace(layout, quantized=config.dtype == "int8")
    ranks, tokens = plan_ranks(staging, num_blocks, layout, config)
    attrs = {**(attrs or {}), "codec": config.codec, "allocation": asdict(config)}
    with StoreWriter(path, layout, ranks, tokens, dtype=config.dtype, attrs=attrs, force=force,
                     lock=lock) as w:
        for i in range(num_blocks):
            w.write_block(pack_block(staging.get(i), ranks[i], config.dtype))
            if progress:
                progress(i)
        if anchor_kv is not None:
            w.write_anchor(anchor_kv)
        if token_ids is not None:
            w.write_token_ids(token_ids)
        if examples is not None:
            w.write_examples(examples["input"], examples["output"], examples["id"], examples["block"])
        return w.commit()
