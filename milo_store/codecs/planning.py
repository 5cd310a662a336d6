"""Pass two's planning: which source a build's blocks come from, and the ranks or widths every block is encoded at.

Pass two reads a *source* of store blocks (see `baselines`): the staged blocks themselves for
``svd``, ``identity`` and ``raw`` (every unit raw, docs/format.md), or a baseline computed from the
staged SVD factors (``global-proj``, ``example-svd``), optionally query-aware (`baselines`).
`plan_store` allocates over all of them and hands back the store codec that encodes them; the storage
room's `milo_store.compress.write_store` writes what it planned.
"""
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import torch

from ..format import GROUP_BYTES, QUANTIZED, TORCH_DTYPES, value_bytes
from ..layout import RAW_RANK, Layout, full_kv_bytes
from .allocation import allocate_ranks
from .baselines import BASELINES, ExampleSplit, GlobalProjection, StagedFactors, WeightedBlocks
from .lowrank import CODECS, BlockFactors, LowRankCodec, measured_losses
from .registry import STORE_CODECS, for_config

CODEC_NAMES = CODECS + ("raw",) + BASELINES + tuple(STORE_CODECS)  # raw: every unit raw (its K/V quantized
# like factors); bits: `bits`


def staging_codec(codec: str) -> str:
    """What pass one stages for a store codec: the baselines derive from the same SVD factors as svd;
    raw stores read the exact K/V an identity staging holds."""
    return "identity" if codec in ("identity", "raw") else "svd"


class StagedBlocks:
    """Pass-two source of ``svd`` and ``identity``: one store block per staged block, as staged."""

    block_group = None

    def __init__(self, staging: StagedFactors, num_blocks: int):
        self.staging, self.num_blocks = staging, num_blocks

    scale = None  # no query-aware weights

    def spectrum(self, i: int) -> tuple[int, torch.Tensor]:
        return self.staging.spectrum(i)

    def factors(self, i: int) -> BlockFactors:
        return self.staging.get(i)


def pass_two_source(staging: StagedFactors, num_blocks: int, config: "CompressionConfig", examples: dict | None = None,
                    channel_scale: torch.Tensor | None = None, layout: Layout | None = None):
    """The store blocks ``config.codec`` writes from ``num_blocks`` staged blocks.

    ``example-svd`` needs ``examples`` with each demonstration's ``block`` and ``tokens``; the other
    codecs ignore them. A query-aware config also needs ``channel_scale`` [L, 2, H, d]
    (`milo_infer.models.channel_scales`), and no other config takes one; ``layout`` says which kinds it must
    weigh (`baselines.weights`: None, keys and values both).
    """
    present = None if layout is None else layout.present
    if config.query_aware and channel_scale is None:
        raise ValueError("a query-aware store needs a channel scale [layers, 2, kv_heads, head_dim] "
                         "(milo_infer.models.channel_scales: from the model's queries and o_proj)")
    if not config.query_aware and channel_scale is not None:
        raise ValueError("a channel scale is only for query-aware stores (query_aware=True)")
    if config.codec == "global-proj":
        return GlobalProjection(staging, num_blocks)
    if config.codec in ("svd", "bits") and config.query_aware:
        return WeightedBlocks(staging, num_blocks, channel_scale, present)
    if config.codec == "example-svd":
        if examples is None or "tokens" not in examples:
            raise ValueError(f"{config.codec} needs the demonstrations' blocks and token counts (examples['tokens'])")
        return ExampleSplit(staging, examples["block"], examples["tokens"], num_blocks, channel_scale, present)
    return StagedBlocks(staging, num_blocks)


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
    query_aware: bool = False  # SVD of X diag(s), s = what each channel's error costs (svd, example-svd)
    # bits: every component's error as the attention output over the assembled context takes it (keys too);
    # kv_split "shared" (one pool for keys and values) always measures so
    in_context: bool = False

    def __post_init__(self):
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.codec!r}; expected one of {CODEC_NAMES}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1]; got {self.ratio}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown factor dtype {self.dtype!r}; expected one of {tuple(TORCH_DTYPES)}")
        if self.query_aware and self.codec not in ("svd", "example-svd", "bits"):
            raise ValueError(f"query-aware weighting applies to the svd, example-svd and bits codecs, not {self.codec!r}")
        if for_config(self.codec) is not None and (not self.query_aware or self.dtype != "float16"):
            raise ValueError(f"the {self.codec} codec is query-aware (query_aware=True) and decodes to float16 factors")
        if self.policy == "frontier" and (self.codec != "svd" or self.full_rank):
            raise ValueError("the frontier policy (low-rank or raw per unit) applies to the svd codec below full rank")
        if self.in_context and self.codec != "bits":
            raise ValueError(f"errors measured in context (in_context) apply to the bits codec, not {self.codec!r}")
        if not 0 < self.key_share < 1 or (self.key_share != 0.5 and self.kv_split != "separate"):
            raise ValueError(f"key share {self.key_share} must be in (0, 1), and needs kv_split 'separate'")


def quant_layout(layout: Layout, dtype: str) -> Layout:
    """The layout of a store whose factors are ``dtype`` (quantized ones count bytes)."""
    return replace(layout, quant=dtype if dtype in QUANTIZED else None)


# Fields added after stores were first written, with their defaults: a store's allocation record
# holds them only when they differ, so the records of existing stores (and every key derived from
# them: reuse checks, prediction logs) stay what they were.
LATER_FIELDS = {"query_aware": False, "in_context": False}


def allocation_record(config: CompressionConfig | dict) -> dict:
    """The ``allocation`` attribute a store written with ``config`` carries; given a stored record,
    the same record as a store written now would carry it (for comparisons and keys)."""
    record = asdict(config) if isinstance(config, CompressionConfig) else dict(config or {})
    return {k: v for k, v in record.items() if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}


def check_layout(layout: Layout, config: CompressionConfig) -> None:
    """Refuse a codec that needs every layer alike (one head size, keys and values in every layer) for a layout whose
    layers differ (Gemma 4's): the bits codec's and the baselines' bases are per (layer, kind, head) of one width."""
    if not layout.uniform and (for_config(config.codec) is not None or config.codec in BASELINES):
        raise ValueError(f"the {config.codec} codec needs every layer to hold keys and values of one head size; this "
                         f"model's layers differ ({', '.join(layout.layer_groups())}): build with --codec svd")


def check_budget(layout: Layout, tokens, config: CompressionConfig) -> None:
    """Raise BudgetError now if ``config.ratio`` cannot hold r_min everywhere (before any encoding), and ValueError
    for a codec this layout cannot take (`check_layout`).

    It runs the allocator itself on empty spectra, so every pool's budget (scope, K/V split, key
    share, per-token scales) is checked as pass two will check it. Exact for block-level codecs;
    example-svd's finer units are checked again when it allocates.
    """
    check_layout(layout, config)
    if (store_codec := for_config(config.codec)) is not None:  # its widths may all be 0: its index bounds it
        store_codec.fixed_bytes(quant_layout(layout, config.dtype), tokens, config.ratio)
        return
    if config.codec in ("identity", "raw") or config.full_rank:
        return
    layout = quant_layout(layout, config.dtype)
    tokens = np.asarray(tokens, dtype=np.int64)
    itemsize = value_bytes(config.dtype)
    silent = np.zeros((len(tokens), layout.num_layers, 2, layout.num_kv_heads, layout.head_dim))
    allocate_ranks(silent, tokens, layout, config.ratio, policy="entropy", scope=config.scope,
                   kv_split=config.kv_split, r_min=config.r_min, r_max=config.r_max, bytes_per_value=itemsize,
                   key_share=config.key_share)


def plan_ranks(staging: StagedFactors, num_blocks: int, layout: Layout, config: CompressionConfig,
               examples: dict | None = None, channel_scale: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ranks [N, L, 2, H], tokens [N]) of the store blocks ``config`` writes from the staged blocks."""
    return _plan(pass_two_source(staging, num_blocks, config, examples, channel_scale, layout),
                 quant_layout(layout, config.dtype), config)


def _plan(source, layout: Layout, config: CompressionConfig, read: Callable[[int], None] = lambda done: None,
          blocks: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ranks and tokens of ``blocks`` (default: every block of the source), allocated together;
    ``read(n)`` after the n-th staged block is read."""
    blocks = list(range(source.num_blocks)) if blocks is None else blocks
    N, d = len(blocks), layout.head_dim
    tokens = np.zeros(N, dtype=np.int64)
    full = np.zeros(N, dtype=np.int64)  # columns each block's factors hold: its full rank
    spectra = np.zeros((N, layout.num_layers, 2, layout.num_kv_heads, d))
    measured = {}  # frontier: what quantizing each direction and each raw form loses, measured per block
    if config.policy == "frontier":
        measured = {"loss": np.zeros_like(spectra), "raw_error": np.zeros(spectra.shape[:4])}
    for i, b in enumerate(blocks):
        if measured:
            f = source.factors(b)
            tokens[i], s = f.tokens, f.S
            loss, raw_error = measured_losses(f, config.dtype, source.scale, layout)
            measured["loss"][i, ..., :s.shape[-1]], measured["raw_error"][i] = loss.numpy(), raw_error.numpy()
        else:
            tokens[i], s = source.spectrum(b)
        full[i] = s.shape[-1]
        spectra[i, ..., :full[i]] = s.double().numpy()
        read(i + 1)
    if config.codec == "raw":
        return np.where(layout.present, RAW_RANK, 0)[None].repeat(N, 0).astype(np.int16), tokens
    if config.codec == "identity" or config.full_rank:  # each unit's every column (its width's, past T none)
        width = np.broadcast_to(layout.widths, layout.present.shape)
        return (np.minimum(full.reshape(-1, 1, 1, 1), width) * layout.present).astype(np.int16), tokens
    ratio = config.ratio
    if source.block_group is not None:  # the group index is not in allocation's index: take it off the budget
        ratio -= GROUP_BYTES * N / full_kv_bytes(layout, tokens)
    itemsize = value_bytes(config.dtype)
    ranks = allocate_ranks(spectra, tokens, layout, ratio, policy=config.policy, scope=config.scope,
                           kv_split=config.kv_split, r_min=config.r_min, r_max=config.r_max, eps=config.eps,
                           seed=config.seed, bytes_per_value=itemsize, key_share=config.key_share, **measured)
    return ranks, tokens


def plan_store(staging: StagedFactors, num_blocks: int, layout: Layout, config: CompressionConfig, *,
               examples: dict | None = None, channel_scale: torch.Tensor | None = None, previous=None,
               reused: dict[int, int] | None = None, value_attention=None,
               read: Callable[[int, int], None] = lambda done, total: None):
    """(source, codec): the pass-two source of ``num_blocks`` staged blocks and the store codec that holds
    every block's ranks or widths and tokens, allocated together (``layout`` already `quant_layout`'s).

    An update's ``previous`` store version and ``reused`` {block: previous block whose bytes it keeps} keep
    those blocks' ranks or widths; only the others are allocated (``read(n, total)`` after the n-th of
    ``total`` is read).
    ``value_attention(i, keys)``: calibration attention for a codec that measures values' errors through
    it (`bits`); the low-rank codec ignores it.
    """
    check_layout(layout, config)
    reused = reused or {}
    if reused and (previous is None or config.codec in BASELINES):
        raise ValueError("reused blocks come from a previous version of a store of block-level codec "
                         f"(not {', '.join(BASELINES)}, whose blocks depend on the whole corpus)")
    store_codec = for_config(config.codec)  # None: the low-rank codec's allocation and packing
    if store_codec is not None and previous is not None:  # new blocks are factored under the store's own weights
        channel_scale = previous.codec.weights
    source = pass_two_source(staging, num_blocks, config, examples, channel_scale, layout)
    encoded = [i for i in range(source.num_blocks) if i not in reused]
    read_one = lambda done: read(done, len(encoded))  # noqa: E731
    if store_codec is not None:
        shape = (source.num_blocks, layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
        widths, tokens = np.zeros(shape, dtype=np.uint8), np.zeros(source.num_blocks, dtype=np.int64)
        if encoded:
            widths[encoded], tokens[encoded] = store_codec.plan_widths(
                source.factors, encoded, layout, source.scale, config.ratio,
                None if config.kv_split == "shared" else config.key_share, value_attention, read_one,
                in_context=config.in_context or config.kv_split == "shared")
        for i, j in reused.items():
            widths[i], tokens[i] = previous.codec.widths[j], previous.block_tokens[j]
        return source, store_codec(layout, widths, source.scale, tokens)
    ranks = np.zeros((source.num_blocks, layout.num_layers, 2, layout.num_kv_heads), dtype=np.int16)
    tokens = np.zeros(source.num_blocks, dtype=np.int64)
    if encoded:
        ranks[encoded], tokens[encoded] = _plan(source, layout, config, read_one, encoded)
    for i, j in reused.items():
        ranks[i], tokens[i] = previous.ranks[j], previous.block_tokens[j]
    return source, LowRankCodec(layout, config.dtype, ranks, tokens)


def demonstration_blocks(source, examples: dict | None) -> list[int]:
    """Each demonstration's store block: its own under ``example-svd``, else the one it was staged in."""
    return source.example_block if isinstance(source, ExampleSplit) else (examples or {}).get("block", [])
