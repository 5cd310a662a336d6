"""Every method's store for one (corpus, block size, context blocks) from one run of the model.

The expensive part of a build is the encoding; `build_store` stages full-rank factors under a
fingerprint that leaves out the ratio, policy, scope, dtype and full_rank flag, so stores that differ
only in those share one staging. The staged codec is in the fingerprint (identity factors are not SVD
factors; the baselines are computed from the SVD staging, `staging_codec`), but an identity staging
holds the block's exact fp32 K/V, so the SVD staging is factored from it instead of encoding again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from milo_store import CompressionConfig, MiloStore, Staging, StoreError, factorize_block
from milo_store.codecs.planning import allocation_record, staging_codec

from .builder import build_store
from .config import BuildConfig, corpus_fingerprint
from ..tasks.corpus import Demonstration, TaskSpec
from ..models import LoadedModel


def encode_once(loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, base: BuildConfig,
                stores: dict[str, CompressionConfig], root, *, progress: bool = True, reuse: bool = True
                ) -> dict[str, dict]:
    """Build each named store under ``root`` from one encoding; returns each one's build summary.

    A store already at its path built the same way (demonstrations, blocks, allocation, model) is
    kept as is, unless ``reuse`` is False (then it is written again, from the staged encoding). Each
    codec's staged factors live in ``root/staging-<fingerprint hash>``; a build gets hard links to them in
    its own ``<store>.staging`` (what `build_store` reads and resumes from), and whatever it encodes
    is linked back, even when it is interrupted. Staged files are only ever replaced whole
    (`Staging.put` renames), so sharing them by links is safe. Identity stores are built first so
    that the SVD staging can be factored from their K/V (`_factor_staged`).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name, compression in sorted(stores.items(), key=lambda item: item[1].codec != "identity"):
        out = root / name
        config = dataclasses.replace(base, compression=compression)
        existing = _existing_summary(out, loaded, demos, config) if reuse else None
        if existing is not None:
            summaries[name] = existing
            continue
        fingerprint = corpus_fingerprint(loaded.identity, task, demos, config)
        shared = _staging_dir(root, fingerprint)
        if staging_codec(compression.codec) == "svd":
            _factor_staged(root, fingerprint)
        own = Path(f"{out}.staging")
        if shared.is_dir():
            _link_missing(shared, own)
        try:
            summaries[name] = build_store(out, loaded, demos, task, config, force=True, progress=progress,
                                          keep_staging=True)
        finally:
            if own.is_dir():
                _link_missing(own, shared)
                shutil.rmtree(own)
    return {name: summaries[name] for name in stores}


def _staging_dir(root: Path, fingerprint: dict) -> Path:
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return root / f"staging-{digest[:16]}"


def _factor_staged(root: Path, fingerprint: dict) -> None:
    """Stage SVD factors of every block an identity staging of the same encoding holds.

    Identity factors are A = X (the block's fp32 K/V as encoded), so this is the factorisation
    `build_store` would stage after running the model again, without running it.
    """
    source_fp = {**fingerprint, "codec": "identity"}
    source_dir = _staging_dir(root, source_fp)
    if not source_dir.is_dir():
        return
    source, target = Staging(source_dir, source_fp), Staging(_staging_dir(root, fingerprint), fingerprint)
    for f in sorted(source_dir.glob("block_*.safetensors")):
        i = int(f.stem.removeprefix("block_"))
        if not target.has(i):
            x = source.get(i).A  # [L, 2, H, T, d]
            target.put(i, factorize_block(x[:, 0], x[:, 1], codec="svd"))


def _link_missing(src: Path, dst: Path) -> None:
    """Hard-link every finished file of ``src`` that ``dst`` lacks (temporaries start with a dot)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(".") and not (dst / f.name).exists():
            os.link(f, dst / f.name)


def _existing_summary(out: Path, loaded: LoadedModel, demos: list[Demonstration], config: BuildConfig) -> dict | None:
    """The accounting of a finished store at ``out`` built the same way, else None (rebuild it)."""
    try:
        with MiloStore.open(out, tier="disk", verify=False) as store:
            build = store.meta.get("build", {})
            same = (allocation_record(store.meta.get("allocation")) == allocation_record(config.compression)
                    and store.meta.get("model", {}).get("config_hash") == loaded.identity["config_hash"]
                    and [build.get(f) for f in ("block_size", "context_blocks", "order", "seed")]
                    == [config.block_size, config.context_blocks, config.order, config.seed]
                    and sorted(store.examples()["id"]) == sorted(d.id for d in demos))
            acc, blocks = store.accounting(), store.num_blocks
    except StoreError:
        return None
    if not same:
        return None
    return {"store": str(out), "blocks": blocks, "blocks_encoded_now": 0, "reused": True,
            "full_fp16_bytes": acc["full_fp16_bytes"], "stored_bytes": acc["total_bytes"],
            "disk_bytes": acc["disk_bytes"], "ratio": acc["ratio"]}
