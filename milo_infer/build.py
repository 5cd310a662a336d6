"""Build a store from a demonstration corpus with a real model (issue: `milo build`).

Pass one encodes each block of m demonstrations as [anchor][w previous blocks][block], keeps only
the block's own pre-RoPE keys and values, factors them at full rank and stages them on disk (so a
killed build resumes and memory stays bounded by one block). Pass two allocates ranks over every
staged spectrum and writes the store. The anchor's K/V is stored once, uncompressed.
A query-aware store (``compression.query_aware``) also runs the model once over a calibration sample
of the corpus for its channel weights (`channel_scales`); they are recomputed on resume, not staged.
"""
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from milo_store import CompressionConfig, Layout, MiloStore, Staging, factorize_block, write_store
from milo_store.allocation import BudgetError
from milo_store.compress import check_budget, staging_codec
from milo_store.urls import is_url, local_sidecar
from milo_store.writer import StoreLock, check_target

from .corpus import Demonstration, TaskSpec
from .models import LoadedModel, capture_kv, channel_scales


CALIBRATION_TOKENS = 2048  # query-aware stores' query statistics: the anchor and the first demonstrations, in block order


class BuildError(ValueError):
    """The build's input is unusable; raised before any long work starts."""


@dataclass
class BuildConfig:
    block_size: int = 32
    context_blocks: int = 2
    order: str = "random"  # or "corpus"
    seed: int = 0
    compression: CompressionConfig = field(default_factory=CompressionConfig)


def group_blocks(n: int, block_size: int, order: str, seed: int) -> list[list[int]]:
    """Demonstration indices per block: seeded shuffle or corpus order, the last block may be short."""
    if order not in ("random", "corpus"):
        raise BuildError(f"unknown block order {order!r}; expected 'random' or 'corpus'")
    idx = list(range(n))
    if order == "random":
        random.Random(seed).shuffle(idx)
    return [idx[i:i + block_size] for i in range(0, n, block_size)]


def tokenize(tokenizer, task: TaskSpec, demos: list[Demonstration]) -> tuple[list[int], list[list[int]]]:
    """Anchor ids (with the tokenizer's special prefix, if any) and each demonstration's ids alone."""
    anchor = tokenizer(task.anchor, add_special_tokens=True).input_ids
    return anchor, [tokenizer(task.render(d), add_special_tokens=False).input_ids for d in demos]


def validate(demos, task: TaskSpec, config: BuildConfig, out: Path, force: bool, max_positions: int,
             anchor_ids, demo_ids) -> None:
    """Every check that can fail, before the first forward pass."""
    if not demos:
        raise BuildError("the corpus is empty")
    if config.block_size < 1:
        raise BuildError(f"block size must be at least 1; got {config.block_size}")
    if config.block_size > len(demos):
        raise BuildError(f"block size {config.block_size} is larger than the corpus ({len(demos)} demonstrations)")
    if config.context_blocks < 0:
        raise BuildError(f"context blocks must be >= 0; got {config.context_blocks}")
    check_target(out, force)
    for d, ids in zip(demos, demo_ids):
        if len(anchor_ids) + len(ids) > max_positions:
            raise BuildError(f"demonstration {d.id!r} is {len(ids)} tokens: with the anchor it exceeds the model's "
                             f"context of {max_positions}")


def corpus_fingerprint(identity: dict, task: TaskSpec, demos, config: BuildConfig) -> dict:
    """What pass one depends on: a staged block is reused only when all of it matches."""
    text = hashlib.sha256(json.dumps([[d.id, d.input, d.output] for d in demos]).encode()).hexdigest()
    return {"model": identity["config_hash"], "model_name": identity["name"], "task": asdict(task), "corpus": text,
            "block_size": config.block_size, "context_blocks": config.context_blocks, "order": config.order,
            "seed": config.seed, "codec": staging_codec(config.compression.codec)}


def encode_block(model, captured_len: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ``ids`` and return the last ``captured_len`` tokens' pre-RoPE K and V, each [L, H, T, d]."""
    with capture_kv(model) as kv, torch.inference_mode():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    keys = torch.stack([k[0, -captured_len:].transpose(0, 1) for k in kv.keys])
    values = torch.stack([v[0, -captured_len:].transpose(0, 1) for v in kv.values])
    return keys.float(), values.float()


def build_store(out, loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, config: BuildConfig, *,
                force: bool = False, progress: bool = True, keep_staging: bool = False) -> dict:
    """Build (or resume building) the store at ``out``; returns the closing summary."""
    out = out if is_url(out) else Path(out)
    model, tok, identity = loaded.model, loaded.tokenizer, loaded.identity
    anchor_ids, demo_ids = tokenize(tok, task, demos)
    max_positions = identity["max_position_embeddings"]
    validate(demos, task, config, out, force, max_positions, anchor_ids, demo_ids)
    blocks = group_blocks(len(demos), config.block_size, config.order, config.seed)
    block_ids = [[t for i in b for t in demo_ids[i]] for b in blocks]
    w = config.context_blocks
    longest = max(len(anchor_ids) + sum(len(x) for x in block_ids[max(0, i - w):i + 1]) for i in range(len(blocks)))
    if longest > max_positions:
        raise BuildError(f"an encoding context of {longest} tokens exceeds the model's {max_positions}; "
                         f"use a smaller --block-size or fewer --context-blocks")
    layout = Layout(identity["num_layers"], identity["num_kv_heads"], identity["head_dim"])
    try:
        check_budget(layout, [len(b) for b in block_ids], config.compression)
    except BudgetError as e:
        raise BuildError(str(e)) from None
    times = {"encode_s": 0.0, "factorize_s": 0.0, "write_s": 0.0}
    with StoreLock(out) as lock:  # one build per path, across both passes
        # Under the lock: opening staging with another fingerprint wipes it, which must not hit a running build.
        staging = Staging(local_sidecar(out, "staging"), corpus_fingerprint(identity, task, demos, config))
        todo = [i for i in range(len(blocks)) if not staging.has(i)]
        tokens_todo = sum(len(block_ids[i]) for i in todo)
        bar = tqdm(total=tokens_todo, unit="tok", desc=f"encoding {len(todo)} blocks", disable=not progress)
        for i in todo:
            t0 = time.perf_counter()
            context = anchor_ids + [t for b in block_ids[max(0, i - w):i] for t in b]
            keys, values = encode_block(model, len(block_ids[i]), context + block_ids[i])
            t1 = time.perf_counter()
            staging.put(i, factorize_block(keys, values, codec=staging_codec(config.compression.codec)))
            times["encode_s"] += t1 - t0
            times["factorize_s"] += time.perf_counter() - t1
            bar.update(len(block_ids[i]))
        bar.close()
        # An empty anchor (no instruction, no tokenizer prefix) has no K/V, and a model refuses zero tokens.
        anchor_kv = (torch.stack(encode_block(model, len(anchor_ids), anchor_ids), dim=1) if anchor_ids else
                     torch.zeros(layout.num_layers, 2, layout.num_kv_heads, 0, layout.head_dim))
        t0 = time.perf_counter()
        attrs = {"model": identity, "task": asdict(task),
                 "build": {"block_size": config.block_size, "context_blocks": w, "order": config.order,
                           "seed": config.seed, "anchor_token_ids": anchor_ids}}
        examples = {"input": [], "output": [], "id": [], "block": [], "tokens": []}
        for b, members in enumerate(blocks):
            for i in members:
                examples["input"].append(demos[i].input)
                examples["output"].append(demos[i].output)
                examples["id"].append(demos[i].id)
                examples["block"].append(b)
                examples["tokens"].append(len(demo_ids[i]))
        channel_scale = None
        if config.compression.query_aware:
            sample = (anchor_ids + [t for b in block_ids for t in b])[:min(CALIBRATION_TOKENS, max_positions)]
            channel_scale = channel_scales(model, sample)
        path = write_store(out, staging, len(blocks), layout, config.compression, attrs=attrs,
                           anchor_kv=anchor_kv, examples=examples, channel_scale=channel_scale,
                           token_ids=np.concatenate([np.asarray(b, dtype=np.int32) for b in block_ids]),
                           force=force, lock=lock)
        if not keep_staging:  # under the lock: a build that starts now must not resume from it
            staging.remove()
    times["write_s"] = time.perf_counter() - t0
    with MiloStore.open(path, tier="disk", verify=False) as store:
        acc = store.accounting()
    return {"store": str(path), "blocks": len(blocks), "demonstrations": len(demos),
            "tokens": int(sum(len(b) for b in block_ids)), "blocks_encoded_now": len(todo),
            "tokens_encoded_now": tokens_todo,
            "full_fp16_bytes": acc["full_fp16_bytes"], "stored_bytes": acc["total_bytes"],
            "disk_bytes": acc["disk_bytes"], "ratio": acc["ratio"], **times}
