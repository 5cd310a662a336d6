"""Build a store from a demonstration corpus with a real model.

Pass one encodes each block of m demonstrations as [anchor][w previous blocks][block], keeps only
the block's own pre-RoPE keys and values, factors them at full rank and stages them on disk (so a
killed build resumes and memory stays bounded by one block). Pass two allocates ranks over every
staged spectrum and writes the store. The anchor's K/V is stored once, uncompressed.
A query-aware store (``compression.query_aware``) also runs the model once over a calibration sample
of the corpus for its channel weights (`channel_scales`); they are recomputed on resume, not staged.

Several blocks can share one forward pass (``encode_batch``, `milo_infer.building.encoding`), and several
processes can share pass one (torchrun; `milo_infer.building.distributed`): each rank encodes a deterministic
share of the batches into one staging directory, rank 0 alone runs pass two. Batches are fixed by the
arguments, not by the number of processes, so the store holds the same bytes as a one-process build
with the same per-process thread count.

`build_store` runs the steps in order: `plan_build` (every check, before any long work),
`coordinate_ranks` (the lock, the staging, which rank encodes what), `encode_share` (pass one) and, on
rank 0, `commit` (pass two). What a build is asked to do is `milo_infer.building.config`.
"""
import contextlib
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from milo_store import Layout, MiloStore, Staging, factorize_block, text_index, write_store
from milo_store.codecs import STORE_CODECS
from milo_store.codecs.planning import check_budget, staging_codec
from milo_store.urls import is_url, local_sidecar
from milo_store.writer import StoreLock, check_target

from ..models import LoadedModel, channel_scales, identity_layout, key_gains, media_tokens
from .calibration import calibration_query_ids, context_attention, context_query_ids, value_attention
from ..tasks.corpus import Demonstration, TaskSpec
from .config import BuildConfig, BuildError, corpus_fingerprint
from .distributed import World
from .encoding import encode_blocks, encoding_units, group_blocks, tokenize


CALIBRATION_TOKENS = 2048  # query-aware stores' query statistics: the anchor and the first demonstrations, in block order


@dataclass
class BuildPlan:
    """What every rank derives from the arguments once they have passed every check."""
    anchor_ids: list[int]
    demo_ids: list[list[int]]  # each demonstration's own ids
    blocks: list[list[int]]  # demonstration indices per block (`group_blocks`)
    block_ids: list[list[int]]  # each block's ids: its demonstrations' in order
    layout: Layout
    units: list[list[int]]  # blocks per forward pass (`encoding_units`)
    fingerprint: dict  # what the staged blocks depend on (`corpus_fingerprint`)


@dataclass
class RankShare:
    """This rank's part of pass one, dealt out by `coordinate_ranks`."""
    staging: Staging
    lock: StoreLock | None  # rank 0's writer lock, held past the commit; None on the other ranks
    todo: dict[int, int]  # tokens of every block still to encode, on any rank
    mine: list[list[int]]  # the encoding units this rank encodes


def build_store(out, loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, config: BuildConfig, *,
                force: bool = False, progress: bool = True, keep_staging: bool = False, staging_dir=None,
                world: World | None = None) -> dict:
    """Build (or resume building) the store at ``out``; returns the closing summary.

    Under torchrun every rank calls this with its own ``world`` (`World.from_env`) and the same
    arguments: each encodes its share of the blocks into ``staging_dir`` (default ``<out>.staging``, or
    a local folder for a store URL; shared storage when ranks are on several machines), then rank 0 allocates and commits. Every
    rank returns rank 0's summary.
    """
    out, world = (out if is_url(out) else Path(out)), world or World()
    staging_dir = Path(staging_dir) if staging_dir else local_sidecar(out, "staging")
    plan = plan_build(out, loaded, demos, task, config, force, world)
    with coordinate_ranks(out, staging_dir, plan, config, world) as share:
        ranks, pass_one_s = encode_share(loaded.model, plan, share, config, world, progress)
        summary = None
        with world.step():
            if world.rank == 0:
                t0 = time.perf_counter()
                path = commit(out, loaded, demos, task, config, plan, share, force, progress)
                if not keep_staging:  # under the lock: a build that starts now must not resume from it
                    share.staging.remove()
                summary = summarize(path, demos, plan, share, ranks, write_s=time.perf_counter() - t0,
                                    pass_one_s=pass_one_s, processes=world.size)
    return world.gather(summary)[0]


def plan_build(out, loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, config: BuildConfig,
               force: bool, world: World) -> BuildPlan:
    """Tokenize and group the corpus, and fail on every rank at once if any check fails: the
    arguments, the corpus, the longest encoding context, the byte budget, the number of processes."""
    with world.step():
        anchor_ids, demo_ids = tokenize(loaded.tokenizer, task, demos, media_tokens(loaded.model.config))
        validate(demos, task, config, out, force, loaded.identity["max_position_embeddings"], anchor_ids, demo_ids,
                 check_out=world.rank == 0)
        blocks = group_blocks(len(demos), config.block_size, config.order, config.seed)
        plan = plan_blocks(loaded.identity, anchor_ids, demo_ids, blocks, range(len(blocks)), config,
                           corpus_fingerprint(loaded.identity, task, demos, config))
        if world.size > len(plan.units):
            raise BuildError(f"{world.size} processes for {len(blocks)} blocks in {len(plan.units)} encoding batch(es) "
                             f"of --encode-batch {config.encode_batch}: use at most {len(plan.units)} processes")
    return plan


def plan_blocks(identity: dict, anchor_ids: list[int], demo_ids: list[list[int]], blocks: list[list[int]], encode,
                config: BuildConfig, fingerprint: dict) -> BuildPlan:
    """The plan to encode the blocks ``encode`` of this layout (a build: all of them; an update: those whose
    encoding changes), once their checks pass: no encoding context longer than the model's, and a byte
    budget that holds rank r_min for the blocks allocated together (those encoded)."""
    block_ids = [[t for i in b for t in demo_ids[i]] for b in blocks]
    w, encode = config.context_blocks, list(encode)
    longest = max((len(anchor_ids) + sum(len(x) for x in block_ids[max(0, i - w):i + 1]) for i in encode), default=0)
    if longest > identity["max_position_embeddings"]:
        raise BuildError(f"an encoding context of {longest} tokens exceeds the model's "
                         f"{identity['max_position_embeddings']}; use a smaller --block-size or fewer --context-blocks")
    layout = identity_layout(identity)
    if encode:
        try:
            check_budget(layout, [len(block_ids[i]) for i in encode], config.compression)
        except ValueError as e:  # a budget that cannot hold r_min, a codec this model's layers cannot take
            raise BuildError(str(e)) from None
    return BuildPlan(anchor_ids, demo_ids, blocks, block_ids, layout, encoding_units(encode, config.encode_batch),
                     fingerprint)


def validate(demos, task: TaskSpec, config: BuildConfig, out: Path, force: bool, max_positions: int,
             anchor_ids, demo_ids, check_out: bool = True) -> None:
    """Every check of the arguments and the corpus that can fail, before the first forward pass."""
    if not demos:
        raise BuildError("the corpus is empty")
    if config.block_size < 1:
        raise BuildError(f"block size must be at least 1; got {config.block_size}")
    if config.block_size > len(demos):
        raise BuildError(f"block size {config.block_size} is larger than the corpus ({len(demos)} demonstrations)")
    if config.context_blocks < 0:
        raise BuildError(f"context blocks must be >= 0; got {config.context_blocks}")
    if config.encode_batch < 1:
        raise BuildError(f"encode batch must be at least 1; got {config.encode_batch}")
    if check_out:  # only the process that writes the store looks at its path
        check_target(out, force)
    if not any(text_index.tokenize(d.input) for d in demos):  # the store's BM25 index needs one word
        raise BuildError("no demonstration's input contains a letter or digit: retrieval would have nothing to match")
    for d, ids in zip(demos, demo_ids):
        if len(anchor_ids) + len(ids) > max_positions:
            raise BuildError(f"demonstration {d.id!r} is {len(ids)} tokens: with the anchor it exceeds the model's "
                             f"context of {max_positions}")


@contextlib.contextmanager
def coordinate_ranks(out, staging_dir: Path, plan: BuildPlan, config: BuildConfig, world: World,
                     lock: StoreLock | None = None):
    """Yield this rank's `RankShare` once the ranks agree on the arguments, rank 0 holds the writer
    lock (until the block exits; ``lock``: one it holds already, as an update does from before it reads
    the store) and has opened the staging, every rank has joined it, the staged blocks' checksums are
    verified (each rank a share), and the units with a block missing are dealt out: rank r encodes
    units r, r + N, ..."""
    world.agree({**plan.fingerprint, **asdict(config.compression), "encode_batch": config.encode_batch})
    with contextlib.ExitStack() as held:
        with world.step():  # a second build into this store fails on every rank here
            if world.rank == 0:  # one build per path: rank 0 holds the writer lock until it has committed
                lock = lock or held.enter_context(StoreLock(out))
                # under the lock: another fingerprint wipes the staging, never a running build's
                staging = Staging(staging_dir, plan.fingerprint)
        world.check_shared(staging_dir)
        with world.step():
            if world.rank != 0:
                staging = Staging(staging_dir, plan.fingerprint, join=True)
        # Resume only from staged blocks that pass their checksums; each rank checks a share.
        staged = world.gather(staging.staged() if world.rank == 0 else None)[0]
        with world.step():
            bad = [i for i in staged[world.rank::world.size] if not staging.verify(i)]
            for i in bad:
                staging.discard(i)
        done = set(staged) - {i for part in world.gather(bad) for i in part}
        todo_units = [u for u in plan.units if not done.issuperset(u)]
        yield RankShare(staging, lock, todo={i: len(plan.block_ids[i]) for u in todo_units for i in u},
                        mine=todo_units[world.rank::world.size])


class StagedProgress:
    """Rank 0's progress bar for the whole job: it counts the staging directory's files (every rank's
    finished blocks), polled from a thread while this rank encodes its own share."""

    def __init__(self, staging: Staging, todo_tokens: dict[int, int], enabled: bool):
        self.staging, self.todo = staging, todo_tokens
        self.bar = tqdm(total=sum(todo_tokens.values()), unit="tok", desc=f"encoding {len(todo_tokens)} blocks",
                        disable=not enabled)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True) if enabled else None

    def _poll(self):
        while not self.stop.wait(1.0):
            self.refresh()

    def refresh(self):
        done = sum(self.todo.get(i, 0) for i in self.staging.staged())
        self.bar.update(done - self.bar.n)

    def __enter__(self):
        if self.thread:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread:
            self.thread.join()
            self.refresh()
        self.bar.close()


def encode_share(model, plan: BuildPlan, share: RankShare, config: BuildConfig, world: World,
                 progress: bool) -> tuple[list[dict], float]:
    """Pass one on this rank: each of its units through the model, each block factored at full rank and
    staged; returns every rank's counts and times, and pass one's wall time."""
    w, codec = config.context_blocks, staging_codec(config.compression.codec)
    encode_s = factorize_s = 0.0
    pass_one, cpu = time.perf_counter(), time.process_time()
    with StagedProgress(share.staging, share.todo, progress and world.rank == 0):
        for unit in share.mine:
            t0 = time.perf_counter()
            rows = [(plan.anchor_ids + [t for b in plan.block_ids[max(0, i - w):i] for t in b] + plan.block_ids[i],
                     len(plan.block_ids[i])) for i in unit]
            encoded = encode_blocks(model, rows)
            t1 = time.perf_counter()
            for i, (keys, values, states) in zip(unit, encoded):
                factors = factorize_block(keys, values, codec=codec, layout=plan.layout)
                factors.states = states
                share.staging.put(i, factors)
            encode_s += t1 - t0
            factorize_s += time.perf_counter() - t1
        mine_blocks = [i for u in share.mine for i in u]
        ranks = world.gather({"rank": world.rank, "host": world.host, "device": str(world.device),
                              "blocks": len(mine_blocks), "tokens": sum(share.todo[i] for i in mine_blocks),
                              "encode_s": encode_s, "factorize_s": factorize_s,
                              "cpu_s": time.process_time() - cpu})  # < the wall time: a CPU shared with others
    return ranks, time.perf_counter() - pass_one


class StageBars:
    """Pass two's progress (``write_store``'s stages: allocating, writing), one bar per stage, so the
    seconds after the encoding bar ends are not silent."""

    def __init__(self, enabled: bool):
        self.enabled, self.stage, self.bar = enabled, None, None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            self.close()
            self.stage, self.bar = stage, tqdm(total=total, unit="step", desc=stage, disable=not self.enabled)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def commit(out: Path, loaded: LoadedModel, demos, task, config: BuildConfig, plan: BuildPlan, share: RankShare,
           force: bool, progress: bool, previous: MiloStore | None = None, reused: dict[int, int] | None = None,
           purge: set[int] | None = None) -> Path:
    """Pass two, on rank 0 under its lock: the anchor's K/V, the channel scales of a query-aware store,
    allocation over every staged spectrum, and the atomic write. An update gives the ``previous`` version
    and the blocks whose bytes it keeps (``reused``: block -> previous block) and those whose bytes must go
    (``purge``, `write_store`); its anchor is the previous one."""
    model, layout, anchor_ids = loaded.model, plan.layout, plan.anchor_ids
    anchor_kv, anchor_states = ((previous.anchor_kv(), previous.anchor_states()) if previous is not None
                                else encode_anchor(model, anchor_ids, layout))
    attrs = {"model": loaded.identity, "task": task.record(),
             "build": {"block_size": config.block_size, "context_blocks": config.context_blocks,
                       "order": config.order, "seed": config.seed, "anchor_token_ids": anchor_ids}}
    examples = {"input": [], "output": [], "id": [], "block": [], "tokens": []}
    for b, members in enumerate(plan.blocks):
        for i in members:
            examples["input"].append(demos[i].input)
            examples["output"].append(demos[i].output)
            examples["id"].append(demos[i].id)
            examples["block"].append(b)
            examples["tokens"].append(len(plan.demo_ids[i]))
    channel_scale = None
    if config.compression.query_aware:
        sample = (anchor_ids + [t for b in plan.block_ids for t in b])[:min(CALIBRATION_TOKENS,
                                                                            loaded.identity["max_position_embeddings"])]
        channel_scale = channel_scales(model, sample)
    attend = None
    if STORE_CODECS.get(config.compression.codec) is not None:  # a store codec that measures values through attention
        attend = value_attention(loaded, anchor_ids, calibration_query_ids(loaded.tokenizer, task, demos))
        if config.compression.in_context or config.compression.kv_split == "shared":  # errors measured in context
            attend.in_context = context_attention(loaded, anchor_ids, anchor_kv,
                                                  context_query_ids(loaded.tokenizer, task, demos))
    bars = StageBars(progress)
    try:
        return write_store(out, share.staging, len(plan.blocks), layout, config.compression, attrs=attrs,
                           anchor_kv=anchor_kv, anchor_states=anchor_states,
                           key_gain=previous.key_gains() if previous is not None else key_gains(model),
                           examples=examples, channel_scale=channel_scale,
                           token_ids=np.concatenate([np.asarray(b, dtype=np.int32) for b in plan.block_ids]),
                           force=force, lock=share.lock, progress=bars, previous=previous, reused=reused,
                           purge=purge, value_attention=attend)
    finally:
        bars.close()


def encode_anchor(model, anchor_ids: list[int], layout: Layout) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The anchor's K/V [L, 2, H, T, d] on the CPU, on the layers' grid, and each linear layer's state section over it
    (`encode_blocks`). An empty anchor (no instruction, no tokenizer prefix) has no K/V and hands a state on as it
    finds it (M = I, C and the conv tail zero), and a model refuses zero tokens."""
    if not anchor_ids:
        return (torch.zeros(layout.num_layers, 2, layout.num_kv_heads, 0, layout.head_dim),
                {l: unchanged_section(layout, l) for l, spec in enumerate(layout.layers) if spec.state_values})
    keys, values, states = encode_blocks(model, [(anchor_ids, len(anchor_ids))])[0]
    return torch.stack((keys, values), dim=1).cpu(), states


def unchanged_section(layout: Layout, layer: int) -> torch.Tensor:
    """Linear ``layer``'s state section of no tokens: M the identity (a Mamba2 layer's ones; a short convolution's
    none), C and the conv tail zero."""
    section = torch.zeros(layout.layers[layer].state_values)
    m = layout.state_section(layer, section)["M"]  # a view: written through
    if m.dim() == 3:
        m.copy_(torch.eye(m.shape[-1]))
    else:
        m.fill_(1.0)
    return section


def summarize(path: Path, demos, plan: BuildPlan, share: RankShare, ranks: list[dict], *, write_s: float,
              pass_one_s: float, processes: int) -> dict:
    """The closing summary: the store's sizes, what this run encoded, and where the time went."""
    with MiloStore.open(path, tier="disk", verify=False) as store:
        acc = store.accounting()
    return {"store": str(path), "blocks": len(plan.blocks), "demonstrations": len(demos),
            "tokens": int(sum(len(b) for b in plan.block_ids)), "blocks_encoded_now": len(share.todo),
            "tokens_encoded_now": sum(share.todo.values()),
            "full_fp16_bytes": acc["full_fp16_bytes"], "stored_bytes": acc["total_bytes"],
            "disk_bytes": acc["disk_bytes"], "ratio": acc["ratio"],
            # process-seconds over every rank; pass_one_s is the wall time of encoding + staging
            "encode_s": sum(r["encode_s"] for r in ranks),
            "factorize_s": sum(r["factorize_s"] for r in ranks),
            "write_s": write_s, "pass_one_s": pass_one_s, "processes": processes,
            "ranks": ranks}
