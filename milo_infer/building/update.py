"""Update a store: add demonstrations and remove them by id, encoding only the blocks that change.

A block's K/V depend only on [anchor][its w context blocks][the block], so the update lays out the new
version's blocks and encodes a block only where that encoding input changed; every other block keeps
the previous version's bytes (and ranks). The layout (docs/design.md, "Update"):

- a removed demonstration leaves its block, which is not re-cut (the blocks after it keep their
  demonstrations); a block left with none is dropped, and the blocks after it move down one index;
- added demonstrations (shuffled among themselves with the store's seed in a ``random``-order store,
  in file order in a ``corpus``-order one) first fill the last block up to the block size, then form new
  blocks;
- a block whose token ids and context blocks' token ids are those of a previous block is that block,
  byte for byte; the others are encoded (with the blocks whose context changed: the w after a changed
  block). The blocks whose K/V saw a removed demonstration are purged: no chunk the new version
  references holds their bytes (`milo_store.writer.StoreWriter`).

A store of format 3 or older is migrated by its first update: the new version is format 4, every kept
block written once into chunks (the summary's ``migrated_from``).

The store's task (template, anchor, labels), block size, context blocks, order and compression are the
previous version's; the model must be the one that built it. The steps are build's
(`milo_infer.building.builder`): `plan_update` (every check, under the writer lock, before any encoding),
then `coordinate_ranks`, `encode_share` and `commit` with the previous version and the blocks it keeps.
"""
import hashlib
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from milo_store import CompressionConfig, MiloStore
from milo_store.blockcache import BlockCache
from milo_store.codecs.planning import BASELINES, allocation_record, staging_codec
from milo_store.errors import LostRaceError, NotAStoreError
from milo_store.format import FORMAT_VERSION
from milo_store.urls import is_url, local_sidecar
from milo_store.writer import StoreLock

from ..models import LoadedModel, check_compatible, media_tokens
from ..tasks.corpus import Demonstration, TaskSpec
from .builder import BuildPlan, commit, coordinate_ranks, encode_anchor, encode_share, plan_blocks, summarize
from .config import BuildConfig, BuildError
from .distributed import World
from .encoding import tokenize

MAX_LISTED = 10  # bad rows named in one error; the rest are counted
ANCHOR_TOLERANCE = 1e-2  # of the anchor's largest |K/V|: the same weights agree to rounding, others by far more


@dataclass
class UpdatePlan:
    """What an update writes: build's plan over the new version's blocks, and what it keeps."""
    plan: BuildPlan
    config: BuildConfig
    task: TaskSpec
    demos: list[Demonstration]  # the new version's, indexed by plan.blocks
    reused: dict[int, int]  # block -> the previous version's block whose bytes it keeps
    purge: set[int]  # the previous version's blocks whose K/V saw a removed demonstration: their bytes must go
    removed: list[str]
    added: int


def update_store(location, loaded: LoadedModel, add: list[Demonstration] = (), remove: list[str] = (), *,
                 source: str = "the added demonstrations", encode_batch: int = 1, progress: bool = True,
                 staging_dir=None, world: World | None = None) -> dict:
    """Add ``add`` to the store at ``location`` (a directory or URL) and remove the demonstrations with
    ids ``remove``, as a new version committed like a build; returns the closing summary.

    ``source`` names the added demonstrations in errors (a file). The writer lock is taken before the
    store is read and held to the commit; a lost race (a URL changed by another machine) removes what
    this update staged and uploaded. It runs in one process (``world``: its device, for the summary).
    """
    location = location if is_url(location) else Path(location)
    if not is_url(location) and not location.is_dir():  # before the lock, which would make its parents
        raise NotAStoreError(f"{location}: no such store directory")
    staging_dir = Path(staging_dir) if staging_dir else local_sidecar(location, "staging")
    world = world or World()
    if world.size > 1:
        raise BuildError(f"an update runs in one process; {world.size} were started")
    with StoreLock(location) as lock, MiloStore.open(location, tier="disk", block_cache=BlockCache(limit_bytes=0)) as previous:
        u = plan_update(previous, loaded, list(add), list(remove), source, encode_batch)
        with coordinate_ranks(location, staging_dir, u.plan, u.config, world, lock=lock) as share:
            ranks, pass_one_s = encode_share(loaded.model, u.plan, share, u.config, world, progress)
            t0 = time.perf_counter()
            try:
                path = commit(location, loaded, u.demos, u.task, u.config, u.plan, share, True, progress,
                              previous=previous, reused=u.reused, purge=u.purge)
            except LostRaceError:  # its base is gone: nothing staged can be used again
                share.staging.remove()
                raise
            share.staging.remove()
    summary = summarize(path, u.demos, u.plan, share, ranks, write_s=time.perf_counter() - t0,
                        pass_one_s=pass_one_s, processes=1)
    migrated = {"migrated_from": previous.format_version} if previous.format_version < FORMAT_VERSION else {}
    return {**summary, "blocks_kept": len(u.reused), "removed": len(u.removed), "added": u.added, **migrated}


def plan_update(previous: MiloStore, loaded: LoadedModel, add: list[Demonstration], remove: list[str], source: str,
                encode_batch: int) -> UpdatePlan:
    """Every check of an update, then the new version's blocks and which of them keep their bytes."""
    config, task, removed = check_request(previous, add, remove, source, encode_batch)
    check_model(previous, loaded, task)
    examples = previous.examples()
    kept = [e for e, i in enumerate(examples["id"]) if i not in removed]
    demos = [Demonstration(examples["input"][e], examples["output"][e], examples["id"][e]) for e in kept] + add
    anchor_ids, demo_ids = tokenize(loaded.tokenizer, task, demos, media_tokens(loaded.model.config))
    check_additions(add, source, task, set(examples["id"]) - removed,
                    (demo_ids[len(kept):], len(anchor_ids), loaded.identity["max_position_embeddings"]))
    old_block_ids = stored_block_ids(previous, examples, kept, demo_ids)
    blocks = lay_out(members_of(examples["block"], previous.num_blocks), kept, len(add), config)
    block_ids = [[t for i in b for t in demo_ids[i]] for b in blocks]
    previous_keys = {encoding_key(old_block_ids, b, config.context_blocks): b for b in range(len(old_block_ids))}
    keys = [encoding_key(block_ids, i, config.context_blocks) for i in range(len(blocks))]
    reused = {i: previous_keys[k] for i, k in enumerate(keys) if k in previous_keys}
    encode = [i for i in range(len(blocks)) if i not in reused]
    holding = {b for e, b in enumerate(examples["block"]) if examples["id"][e] in removed}
    purge = {b + t for b in holding for t in range(config.context_blocks + 1) if b + t < previous.num_blocks}
    if purge & set(reused.values()):  # the encoding key covers every token a block saw: this cannot happen
        raise BuildError(f"{previous.path}: blocks {sorted(purge & set(reused.values()))} would keep K/V of a "
                         "removed demonstration")
    fingerprint = {"update": True, "model": loaded.identity["config_hash"], "model_name": loaded.identity["name"],
                   "anchor": hashlib.sha256(np.asarray(anchor_ids, dtype=np.int32).tobytes()).hexdigest(),
                   "codec": staging_codec(config.compression.codec), "blocks": {str(i): keys[i] for i in encode}}
    plan = plan_blocks(loaded.identity, anchor_ids, demo_ids, blocks, encode, config, fingerprint)
    return UpdatePlan(plan, config, task, demos, reused, purge, sorted(removed), len(add))


def check_request(previous: MiloStore, add: list[Demonstration], remove: list[str], source: str,
                  encode_batch: int) -> tuple[BuildConfig, TaskSpec, set[str]]:
    """The checks that need no model (a command runs them before it loads one): the store can be updated,
    the ids to remove are there, and the added demonstrations fit the store's task. Returns the store's
    build configuration, its task, and the ids to remove."""
    config = stored_config(previous, encode_batch)
    task = TaskSpec(**{**previous.meta["task"], "labels": tuple(previous.meta["task"].get("labels", ()))})
    if not add and not remove:
        raise BuildError("nothing to update: add demonstrations (--add FILE), remove some (--remove IDS), or both")
    ids = previous.examples()["id"]
    removed = check_removals(previous, ids, remove)
    if not add and removed >= set(ids):
        raise BuildError(f"{previous.path}: the update removes every demonstration; a store needs at least one")
    check_additions(add, source, task, set(ids) - removed)
    return config, task, removed


def lay_out(previous_blocks: list[list[int]], kept: list[int], added: int, config: BuildConfig) -> list[list[int]]:
    """The new version's blocks, as indices into its demonstrations (``kept`` ones of the previous version's
    examples, then ``added`` new ones): each previous block less its removed demonstrations (none re-cut, an
    emptied one dropped), then the added ones (shuffled among themselves with the store's seed in a
    random-order store) filling the last block up to the block size and forming new blocks."""
    position = {e: k for k, e in enumerate(kept)}  # previous demonstration -> its index in the new version
    blocks = [b for b in ([position[e] for e in members if e in position] for members in previous_blocks) if b]
    fresh = list(range(len(kept), len(kept) + added))
    if config.order == "random":  # as a build shuffles its corpus
        random.Random(config.seed).shuffle(fresh)
    if blocks and len(blocks[-1]) < config.block_size:
        room = config.block_size - len(blocks[-1])
        blocks[-1], fresh = blocks[-1] + fresh[:room], fresh[room:]
    return blocks + [fresh[i:i + config.block_size] for i in range(0, len(fresh), config.block_size)]


def stored_config(store: MiloStore, encode_batch: int) -> BuildConfig:
    """The build configuration the store was written with (an update keeps it); a baseline store is refused."""
    build, codec = store.meta.get("build") or {}, store.meta.get("codec")
    if codec in BASELINES:
        raise BuildError(f"{store.path}: a {codec} store cannot be updated (its blocks depend on the whole corpus); "
                         "rebuild it with `milo build --force`")
    if missing := [k for k in ("block_size", "context_blocks", "order", "seed") if k not in build]:
        raise BuildError(f"{store.path}: the store records no build {', '.join(missing)}: it was not written by "
                         "`milo build`, and cannot be updated")
    if encode_batch < 1:
        raise BuildError(f"encode batch must be at least 1; got {encode_batch}")
    try:
        compression = CompressionConfig(**allocation_record(store.meta.get("allocation")))
    except (TypeError, ValueError) as e:
        raise BuildError(f"{store.path}: the store's allocation record cannot be read back ({e})") from None
    return BuildConfig(block_size=build["block_size"], context_blocks=build["context_blocks"], order=build["order"],
                       seed=build["seed"], encode_batch=encode_batch, compression=compression)


def check_model(store: MiloStore, loaded: LoadedModel, task: TaskSpec) -> None:
    """The model must be the one whose K/V the store holds: the same identity (shapes, config, RoPE, dtype),
    the same anchor ids from its tokenizer, and the same anchor K/V from its weights (the identity names
    no weights)."""
    check_compatible(store, loaded.identity)
    stored = store.meta["model"]
    if stored.get("dtype") != loaded.identity["dtype"]:
        raise BuildError(f"{store.path} holds K/V computed in {stored.get('dtype')}; the model runs in "
                         f"{loaded.identity['dtype']}")
    anchor_ids = loaded.tokenizer(task.anchor_text, add_special_tokens=True).input_ids
    if anchor_ids != store.meta["build"].get("anchor_token_ids"):
        raise BuildError(f"{store.path}: this model's tokenizer writes the store's anchor as other token ids "
                         "than the store's: it is not the tokenizer the store was built with")
    kept = store.anchor_kv()
    if kept is not None and kept.numel():
        now = encode_anchor(loaded.model, anchor_ids, store.layout)[0].to(kept.dtype).float()
        if (now - kept.float()).abs().max() > ANCHOR_TOLERANCE * kept.float().abs().max():
            raise BuildError(f"{store.path}: this model's K/V of the anchor differ from the store's: its weights are "
                             f"not those of the model that built the store ({stored.get('name')})")


def check_removals(store: MiloStore, ids: list[str], remove: list[str]) -> set[str]:
    """The ids to remove, each of which must be in the store."""
    present = set(ids)
    unknown = [i for i in dict.fromkeys(remove) if i not in present]
    if unknown:
        raise BuildError(f"{store.path}: no demonstration with id {listed(unknown)} to remove; nothing was changed")
    return set(remove)


def check_additions(add: list[Demonstration], source: str, task: TaskSpec, taken: set[str],
                    tokens: tuple[list[list[int]], int, int] | None = None) -> None:
    """Every added demonstration the store cannot take, named by its row (1-based, in ``source``) and id, at
    once. ``tokens`` (their token ids, the anchor's length, the model's positions) adds the length check."""
    bad = []
    for row, d in enumerate(add, start=1):
        answer = task.answer_of(d.output)
        if d.id in taken:
            problem = "this id is in the store already (remove it in the same update to replace it)"
        elif task.answer_kind == "label" and answer not in task.labels:
            problem = (f"output {answer!r} is not one of the store's labels; a new label changes the anchor or the "
                       "answers every block was built for: rebuild the store")
        elif task.answer_kind == "number" and answer is None:
            problem = f"output {d.output!r} states no number, and the store's task answers with numbers"
        elif tokens is not None and tokens[1] + len(tokens[0][row - 1]) > tokens[2]:
            problem = f"{len(tokens[0][row - 1])} tokens: with the anchor it exceeds the model's context of {tokens[2]}"
        else:
            continue
        bad.append(f"row {row} (id {d.id!r}): {problem}")
    if bad:
        more = f"; and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        raise BuildError(f"{source}: {len(bad)} demonstration(s) cannot be added, nothing was changed: "
                         + "; ".join(bad[:MAX_LISTED]) + more)


def members_of(example_block: list[int], num_blocks: int) -> list[list[int]]:
    """Each block's demonstrations (indices into the store's examples), in their order in the block."""
    members = [[] for _ in range(num_blocks)]
    for e, b in enumerate(example_block):
        members[b].append(e)
    return members


def stored_block_ids(store: MiloStore, examples: dict, kept: list[int], demo_ids: list[list[int]]) -> list[list[int]]:
    """The token ids of the previous version's blocks, as stored; each must be what the tokenizer gives its
    demonstrations (``demo_ids``, for the ``kept`` ones; removed ones are not tokenized), or the store holds
    other tokens than this tokenizer's and nothing of it can be reused."""
    if store.token_ids(0) is None:
        raise BuildError(f"{store.path}: the store keeps no token ids (it was written before they were): rebuild it")
    position = {e: k for k, e in enumerate(kept)}
    blocks = []
    for b, members in enumerate(members_of(examples["block"], store.num_blocks)):
        ids = store.token_ids(b).tolist()
        if all(e in position for e in members) and ids != [t for e in members for t in demo_ids[position[e]]]:
            raise BuildError(f"{store.path}: block {b}'s stored token ids are not what this model's tokenizer gives "
                             "its demonstrations: the store was built with another tokenizer or template")
        blocks.append(ids)
    return blocks


def encoding_key(block_ids: list[list[int]], i: int, context_blocks: int) -> str:
    """What block i's K/V depend on besides the anchor: its context blocks' token ids, then its own."""
    h = hashlib.sha256()
    for ids in block_ids[max(0, i - context_blocks):i] + [[-1], block_ids[i]]:  # -1: no token id, a separator
        h.update(np.asarray(ids, dtype=np.int32).tobytes())
    return h.hexdigest()


def listed(ids: list[str]) -> str:
    """Ids for an error message: the first MAX_LISTED, then how many more."""
    shown = ", ".join(map(repr, ids[:MAX_LISTED]))
    return shown + (f" and {len(ids) - MAX_LISTED} more" if len(ids) > MAX_LISTED else "")
