"""Build a store from a demonstration corpus or a benchmark data set with a real model.

Every argument, the corpus and the output path are checked before the model is loaded, so a typo
costs a second, not a model load. The build itself (tokenising, one forward pass per block with a
progress bar, rank allocation, the atomic write) is `milo_infer.building.builder.build_store`. A build that is
killed or interrupted keeps its finished blocks in ``<out>.staging``: rerunning the same command
resumes from them.

Under torchrun (``torchrun --nproc-per-node N -m milo_infer.cli.main build ...``) every process
runs this command: each encodes a share of the blocks on its own device into one staging directory
(``--staging``, on storage every rank shares), rank 0 allocates and commits, and every rank exits
with the first failing rank's error (`milo_infer.building.distributed`).
"""
import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import torch

from milo_store import CompressionConfig
from milo_store.codecs.allocation import KV_SPLITS, POLICIES, SCOPES
from milo_store.commandline import print_json
from milo_store.report import human_bytes
from milo_store.codecs.lowrank import CODECS
from milo_store.codecs import STORE_CODECS
from milo_store.format import TORCH_DTYPES
from milo_store.urls import is_url, local_sidecar
from milo_store.writer import check_target

from ..building.builder import build_store
from ..building.config import CUDA_ENCODE_BATCH, BuildConfig, default_compression, default_encode_batch
from ..tasks.corpus import load_corpus, task_from_corpus
from ..tasks.datasets import DATASETS, load_dataset
from ..building.distributed import World
from . import CommandError, at_least, load_model_arg

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def add_arguments(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", metavar="FILE", help="your demonstrations: .jsonl or .csv with input and output fields")
    src.add_argument("--dataset", choices=DATASETS, help="a benchmark data set's training split (from $MILO_DATA)")
    p.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model directory, or a .gguf file")
    p.add_argument("--out", required=True, metavar="STORE", help="store directory or URL (s3://bucket/prefix, ...) to create")
    p.add_argument("--ratio", type=float, default=0.5, help="stored bytes over full fp16 K/V bytes, in (0, 1] (default 0.5)")
    p.add_argument("--block-size", type=int, default=32, help="demonstrations per block (default 32)")
    p.add_argument("--context-blocks", type=int, default=2,
                   help="previous blocks each block is encoded after, beside the anchor (default 2)")
    p.add_argument("--shots", type=int, metavar="N",
                   help="use the first N demonstrations (a data set's are seeded-shuffled; a corpus keeps file order)")
    p.add_argument("--seed", type=int, default=0, help="shuffles the data set, the block order and random allocation")
    p.add_argument("--order", choices=("random", "corpus"), default="random", help="how demonstrations fill blocks")
    p.add_argument("--codec", choices=CODECS + ("raw",) + tuple(STORE_CODECS),
                   help="default: bits below ratio 0.2 (unless --dtype, --policy, --scope, --kv-split or "
                        "--no-query-aware asks for the low-rank codec), svd from 0.2 up (docs/results.md); svd "
                        "(low-rank factors), identity (exact, B = I), raw (every unit's K/V itself in --dtype: "
                        "plain KV quantization, whose ratio is the format's; --ratio does not apply), bits "
                        "(each block's query-weighted SVD, one code width per component chosen store-wide; "
                        "fp16 when decoded, query-aware always; docs/results.md 'Past 4x')")
    p.add_argument("--dtype", choices=("auto",) + tuple(TORCH_DTYPES), default="auto",
                   help="stored factor dtype (default auto: int8 from ratio 0.4 up, where it keeps the full "
                        "cache's accuracy; int4 below, where rank matters more than precision; docs/results.md)")
    p.add_argument("--query-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="svd codec: factor X diag(s), s = what each channel's error costs the model (queries for "
                        "keys, o_proj for values), so rank goes where attention looks; one extra forward pass over "
                        "<= 2048 corpus tokens (default on; docs/results.md)")
    p.add_argument("--policy", choices=POLICIES,
                   help="rank allocation policy; frontier chooses low rank or raw per unit (default: frontier with "
                        "INT8/INT4 factors from ratio 0.2 up, entropy otherwise)")
    p.add_argument("--scope", choices=SCOPES,
                   help="what shares one rank budget (default: global where the policy "
                        "defaults to frontier, head otherwise)")
    p.add_argument("--kv-split", choices=KV_SPLITS,
                   help="budget keys and values apart or together (default: shared where the "
                        "policy defaults to frontier, separate otherwise or with --key-share; with --codec bits, "
                        "shared is one pool whose errors are the attention output's in context: measured worse "
                        "at 8x, docs/results.md)")
    p.add_argument("--key-share", type=float,
                   help="with --kv-split separate: the share of the byte budget given to keys (default 0.5; "
                        "0.25 for the bits codec, where values need the bytes: docs/results.md)")
    p.add_argument("--template", metavar="T",
                   help=r"how a demonstration is written, with {input} then {output}; \n and \t are read as escapes")
    p.add_argument("--anchor", metavar="A", help=r"instruction text before all demonstrations; \n and \t are escapes")
    p.add_argument("--system", metavar="TEXT",
                   help=r"a system prompt, encoded before the anchor: `milo serve` answers a chat whose system message "
                        r"is this text exactly as built (and lists it in /v1/models); \n and \t are escapes")
    p.add_argument("--staging", metavar="DIR", help="where finished blocks wait for pass two, and a rerun resumes "
                   "from (default <out>.staging); with several machines, a directory they all share")
    p.add_argument("--encode-batch", type=int, metavar="N",
                   help="blocks per forward pass, right-padded (default: 1 on a CPU, where batching did not "
                        f"pay in docs/benchmarks.md; {CUDA_ENCODE_BATCH} on a GPU, a guess not yet measured)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads per process; 1 is many times faster on a CPU shared with other jobs "
                        "(default: torch's)")
    p.add_argument("--force", action="store_true", help="replace an existing store at --out")
    p.add_argument("--json", action="store_true", help="print the closing summary as JSON")


def compression_config(args) -> CompressionConfig:
    """The store configuration the arguments ask for: `milo_infer.building.config.default_compression` of them."""
    try:
        return default_compression(args.ratio, args.seed, codec=args.codec,
                                   dtype=None if args.dtype == "auto" else args.dtype, query_aware=args.query_aware,
                                   key_share=args.key_share, policy=args.policy, scope=args.scope,
                                   kv_split=args.kv_split)
    except ValueError as e:
        raise CommandError(str(e)) from None


def unescape(text: str | None) -> str | None:
    r"""``\n``, ``\t`` and ``\\`` as typed in a shell become the characters they name."""
    if text is None:
        return None
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def check_numbers(args) -> None:
    if not 0 < args.ratio <= 1:
        raise CommandError(f"--ratio must be in (0, 1]; got {args.ratio}")
    at_least(args, 1, "block_size")
    at_least(args, 0, "context_blocks")
    at_least(args, 1, "shots", "encode_batch", "threads")


def demonstrations(args):
    """(demonstrations to build from, their task): the first --shots of the corpus or training split."""
    template, anchor = unescape(args.template), unescape(args.anchor)
    if args.corpus is not None:
        demos, source = load_corpus(args.corpus), args.corpus
    else:
        demos, _, task = load_dataset(args.dataset, seed=args.seed)
        source = f"the {args.dataset} training split"
    try:  # TaskSpec refuses a template without {input} then {output}
        if args.corpus is not None:
            task = task_from_corpus(demos, template=template, anchor=anchor)  # labels from the whole corpus
        else:
            task = dataclasses.replace(task, template=template or task.template,
                                       anchor=task.anchor if anchor is None else anchor)
    except ValueError as e:
        raise CommandError(f"--template: {e}") from None
    if args.system is not None:
        if not args.system.strip():
            raise CommandError("--system: the system prompt is empty")
        task = dataclasses.replace(task, system=unescape(args.system))
    if args.shots is not None:
        if args.shots > len(demos):
            raise CommandError(f"--shots {args.shots}: {source} has only {len(demos)} demonstrations")
        demos = demos[:args.shots]
    if args.block_size > len(demos):
        raise CommandError(f"--block-size {args.block_size} is larger than the {len(demos)} demonstrations to build from")
    return demos, task


def run(args) -> int:
    started = time.perf_counter()
    world = World.from_env()
    finished = False
    try:
        code = build(args, world, started)
        finished = True
        return code
    finally:
        world.close(finished)


def build(args, world: World, started: float) -> int:
    out = args.out if is_url(args.out) else Path(args.out)
    with world.step():  # every rank checks its own input and loads the model; one failure stops all
        check_numbers(args)
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if not is_url(out) and out.parent.exists() and not out.parent.is_dir():
            raise CommandError(f"--out {out}: {out.parent} is a file, not a directory")
        if world.rank == 0:
            check_target(out, args.force)
        demos, task = demonstrations(args)
        compression = compression_config(args)
        encode_batch = args.encode_batch or default_encode_batch(world.device)
        config = BuildConfig(block_size=args.block_size, context_blocks=args.context_blocks, order=args.order,
                             seed=args.seed, encode_batch=encode_batch, compression=compression)
        t0 = time.perf_counter()
        loaded = load_model_arg(args.model)
        loaded.model.to(world.device)
        load_s = time.perf_counter() - t0
    staging = Path(args.staging) if args.staging else local_sidecar(out, "staging")
    try:
        summary = build_store(out, loaded, demos, task, config, force=args.force, progress=True,
                              staging_dir=staging, world=world)
    except KeyboardInterrupt:  # not an input error: the shell's code for Ctrl-C, and how to continue
        staged = len(list(staging.glob("block_*.safetensors")))
        print(f"milo build: interrupted with {staged} block(s) staged in {staging}; "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    if world.rank != 0:
        return 0
    summary.update(model=loaded.identity["name"], load_s=load_s, total_s=time.perf_counter() - started)
    if args.json:
        print_json(summary)
    else:
        print_summary(summary)
    return 0


def print_summary(s: dict) -> None:
    """The closing summary for a person: what was built, how small it is, and where the time went."""
    resumed = s["blocks"] - s["blocks_encoded_now"]
    note = f", {resumed} resumed from staging" if resumed else ""
    rate = s["tokens_encoded_now"] / s["encode_s"] if s["encode_s"] else 0.0
    print(f"built    {s['store']}  ({s['model']})")
    print(f"content  {s['blocks']} blocks, {s['demonstrations']} demonstrations, {s['tokens']} tokens{note}")
    print(f"bytes    full fp16 K/V {human_bytes(s['full_fp16_bytes'])} -> stored {human_bytes(s['stored_bytes'])} "
          f"(ratio {s['ratio']:.4f}); on disk {human_bytes(s['disk_bytes'])}")
    print(f"time     encoding {s['encode_s']:.1f} s ({rate:.0f} tok/s), factorizing {s['factorize_s']:.1f} s, "
          f"allocating + writing {s['write_s']:.1f} s, model load {s['load_s']:.1f} s, total {s['total_s']:.1f} s")
    if s["processes"] > 1:
        print(f"ranks    {s['processes']} processes encoded {s['tokens_encoded_now']} tokens in "
              f"{s['pass_one_s']:.1f} s ({s['tokens_encoded_now'] / s['pass_one_s']:.0f} tok/s together; "
              "times above summed over processes)")
        for r in s["ranks"]:
            r_rate = r["tokens"] / r["encode_s"] if r["encode_s"] else 0.0
            print(f"  rank {r['rank']}  {r['host']} {r['device']}: {r['blocks']} blocks, {r['tokens']} tokens, "
                  f"{r_rate:.0f} tok/s encoding")
