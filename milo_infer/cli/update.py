"""Add demonstrations to a store and remove some by id, encoding only the blocks that change.

The store (a directory or URL) keeps its task, block size, context blocks and compression; the model
must be the one that built it. The demonstration file, the ids and every check that needs no model run
before the model loads. The update itself is `milo_infer.building.update.update_store`: a new version,
committed like a build (a killed update leaves the previous version in place; rerunning the same command
resumes from the blocks it staged).
"""
import sys
import time
from pathlib import Path

import torch

from milo_store import MiloStore
from milo_store.commandline import id_list, print_json
from milo_store.format import FORMAT_VERSION
from milo_store.report import human_bytes
from milo_store.urls import is_url, local_sidecar

from ..building.distributed import World
from ..building.update import check_request, update_store
from ..tasks.corpus import load_corpus
from . import CommandError, at_least, load_model_arg


def add_arguments(p):
    p.add_argument("store", help="store directory or URL (s3://bucket/prefix, ...) to update")
    p.add_argument("--add", metavar="FILE", help="demonstrations to add: .jsonl or .csv with input, output and id fields")
    p.add_argument("--remove", action="append", metavar="IDS",
                   help="ids of demonstrations to remove, comma-separated (repeatable); an id both removed and "
                        "added replaces that demonstration")
    p.add_argument("--model", default="default", metavar="PATH",
                   help="the model that built the store: 'default', a Hugging Face model directory, or a .gguf file")
    p.add_argument("--encode-batch", type=int, default=1, metavar="N",
                   help="blocks per forward pass (default 1: the K/V a build with --encode-batch 1 computes, bit for bit)")
    p.add_argument("--staging", metavar="DIR", help="where encoded blocks wait for the commit, and a rerun resumes "
                   "from (default <store>.staging)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the closing summary as JSON")


def run(args) -> int:
    started = time.perf_counter()
    at_least(args, 1, "encode_batch", "threads")
    add, source = (load_corpus(args.add), args.add) if args.add else ([], "--add")
    remove = id_list(args.remove)
    with MiloStore.open(args.store, tier="disk", verify=False) as store:
        check_request(store, add, remove, source, args.encode_batch)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    world = World.from_env()
    if world.size > 1:
        raise CommandError("milo update runs in one process; start it without torchrun")
    loaded = load_model_arg(args.model)
    loaded.model.to(world.device)
    location = args.store if is_url(args.store) else Path(args.store)
    staging = Path(args.staging) if args.staging else local_sidecar(location, "staging")
    try:
        summary = update_store(location, loaded, add, remove, source=source,
                               encode_batch=args.encode_batch, staging_dir=staging, world=world)
    except KeyboardInterrupt:
        staged = len(list(staging.glob("block_*.safetensors")))
        print(f"milo update: interrupted with {staged} block(s) staged in {staging}; the store is unchanged; "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    summary["total_s"] = time.perf_counter() - started
    if args.json:
        print_json(summary)
        return 0
    s = summary
    if "migrated_from" in s:
        print(f"migrated {s['store']}: format {s['migrated_from']} to {FORMAT_VERSION}, once: this update wrote every "
              "block into chunks that later updates keep")
    print(f"updated  {s['store']}: {s['added']} demonstration(s) added, {s['removed']} removed")
    print(f"content  {s['blocks']} blocks ({s['blocks_kept']} kept byte for byte, {s['blocks_encoded_now']} encoded), "
          f"{s['demonstrations']} demonstrations, {s['tokens']} tokens")
    print(f"bytes    full fp16 K/V {human_bytes(s['full_fp16_bytes'])} -> stored {human_bytes(s['stored_bytes'])} "
          f"(ratio {s['ratio']:.4f}); on disk {human_bytes(s['disk_bytes'])}")
    print(f"time     encoding {s['encode_s']:.1f} s, allocating + writing {s['write_s']:.1f} s, total {s['total_s']:.1f} s")
    return 0
