"""What a build is asked to do: its configuration, `milo build`'s defaults (dtype, allocation,
compression, encode batch), the error for unusable input, and the fingerprint a staged block is
reused under."""
import hashlib
import json
from dataclasses import dataclass, field

import torch

from milo_store import CompressionConfig
from milo_store.codecs.planning import staging_codec

from ..tasks.corpus import TaskSpec


class BuildError(ValueError):
    """The build's input is unusable; raised before any long work starts."""


AUTO_INT4_BELOW = 0.4  # Banking77, 3 seeds: int4 ahead at 0.25 and 0.35, int8 at 0.5 (int4 tops out at 0.34)
# `milo build`'s allocation (docs/results.md, "Plain KV quantization"): from ratio 0.2 up, with INT8 or
# INT4 factors, each unit is raw (in that quantization) or factored, whichever removes more error per
# byte, over one store-wide budget for keys and values together (measured ahead at 0.5 and 0.25 on three
# data sets); below, and for other dtypes, the paper's entropy allocation per (layer, head) (ahead at
# 0.125 on Banking77).
FRONTIER = {"policy": "frontier", "scope": "global", "kv_split": "shared"}
FRONTIER_FROM = 0.2
PAPER_ALLOCATION = {"policy": "entropy", "scope": "head", "kv_split": "separate"}


def auto_dtype(ratio: float, codec: str = "svd") -> str:
    """``--dtype auto``: int8 factors from ratio 0.4 up, int4 below; identity stores keep fp16, raw ones int8."""
    if codec in ("identity", "bits"):  # bits: its own code widths, decoded to fp16 factors
        return "float16"
    if codec == "raw":
        return "int8"
    return "int4" if ratio < AUTO_INT4_BELOW else "int8"


def default_allocation(dtype: str, ratio: float) -> dict:
    """The policy, scope and K/V split `milo build` uses with factors of ``dtype`` at ``ratio`` (a fresh dict)."""
    return dict(FRONTIER if dtype in ("int8", "int4") and ratio >= FRONTIER_FROM else PAPER_ALLOCATION)


# Below this ratio `milo build` writes the bits codec with keys on BITS_KEY_SHARE of the budget
# (docs/results.md, "The bits codec in the store": on Banking77 at 0.125 it kept 66% of the full cache's
# answers and its accuracy within a point, against 49% and 9 points for the low-rank codec; at 0.0625 more
# again). From 0.2 up the low-rank codec with the frontier allocation stays, where its agreement was
# measured (87% at 0.25) and the bits codec's was not.
BITS_BELOW = 0.2
BITS_KEY_SHARE = 0.25


def auto_codec(ratio: float, dtype: str | None = None, query_aware: bool = True, allocation: dict | None = None) -> str:
    """``--codec`` not given: bits below `BITS_BELOW`, svd otherwise, and svd wherever a choice only the low-rank
    codec takes is given (a factor dtype, an allocation policy, scope or split, no query-aware weighting)."""
    low_rank_only = dtype is not None or not query_aware or any(v is not None for v in (allocation or {}).values())
    return "bits" if ratio < BITS_BELOW and not low_rank_only else "svd"


def default_compression(ratio: float, seed: int = 0, *, codec: str | None = None, dtype: str | None = None,
                        query_aware: bool = True, key_share: float | None = None, **allocation) -> CompressionConfig:
    """What `milo build` writes: with only the ratio given, its defaults (`milo eval --methods default`
    measures them); every choice given (None: not given) overrides its default.

    ``codec`` defaults to `auto_codec`, ``dtype`` to `auto_dtype`, ``key_share`` to `BITS_KEY_SHARE` for the
    bits codec and 0.5 otherwise; policy, scope and K/V split (``allocation``) to `default_allocation` of
    that dtype for the svd codec, with separate budgets when ``key_share`` is not 0.5. Query-aware weighting
    applies to the svd codec, and the bits codec always takes it. A raw store's ratio is its format's, so it
    records 1.0 (as `milo eval`'s raw methods do).
    """
    codec = codec or auto_codec(ratio, dtype, query_aware, allocation)
    if key_share is None:  # one pool (kv_split "shared") has no keys' share
        key_share = BITS_KEY_SHARE if codec == "bits" and allocation.get("kv_split") != "shared" else 0.5
    dtype = dtype or auto_dtype(ratio, codec)
    chosen = default_allocation(dtype, ratio) if codec == "svd" else {}
    if key_share != 0.5:  # a key share needs separate budgets
        chosen["kv_split"] = "separate"
    chosen.update({name: value for name, value in allocation.items() if value is not None})
    return CompressionConfig(ratio=1.0 if codec == "raw" else ratio, codec=codec, dtype=dtype, key_share=key_share,
                             seed=seed, query_aware=codec == "bits" or (query_aware and codec == "svd"), **chosen)


# Blocks per forward pass when no encode batch is given: 1 on a CPU, where batching did not pay
# (docs/benchmarks.md); on a GPU CUDA_ENCODE_BATCH, a guess that no run has measured yet
# (tools/gpu_bench.sh ends with batch 1 against 8).
CUDA_ENCODE_BATCH = 8


def default_encode_batch(device) -> int:
    """The encode batch `milo build` uses on ``device`` when --encode-batch is not given."""
    return CUDA_ENCODE_BATCH if torch.device(device).type == "cuda" else 1


@dataclass
class BuildConfig:
    block_size: int = 32
    context_blocks: int = 2
    order: str = "random"  # or "corpus"
    seed: int = 0
    encode_batch: int = 1  # blocks per forward pass (encoding_units)
    compression: CompressionConfig = field(default_factory=CompressionConfig)


def corpus_fingerprint(identity: dict, task: TaskSpec, demos, config: BuildConfig) -> dict:
    """What pass one depends on: a staged block is reused only when all of it matches."""
    text = hashlib.sha256(json.dumps([[d.id, d.input, d.output] for d in demos]).encode()).hexdigest()
    return {"model": identity["config_hash"], "model_name": identity["name"], "task": task.record(), "corpus": text,
            "block_size": config.block_size, "context_blocks": config.context_blocks, "order": config.order,
            "seed": config.seed, "codec": staging_codec(config.compression.codec)}
