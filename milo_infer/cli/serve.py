"""Serve mounted stores over an OpenAI-compatible HTTP API (completions, chat completions, models, metrics).

Loads the model once, mounts every store once (each must match the model), and runs until SIGTERM
or Ctrl-C, which drain: no new requests, in-flight ones finish within --drain-s, exit 0 (1 when the
engine loop failed for good). A store's new version (`milo update`) is swapped in while it runs
(--reload-interval, POST /admin/reload).
"""
import os
import sys

import torch

from milo_store import MiloStore
from milo_store.blockcache import parse_size

from ..server import MAX_BODY_BYTES
from ..server.warmup import WARMUP_MODES, should_warm, warm_engine, warm_sizes
from ..runtime.attention import ATTENTIONS
from ..runtime.engine import LOAD_ERROR_POLICIES
from ..runtime.planning import EngineSettings
from ..runtime.session import place_model
from . import CommandError, add_tier_arguments, at_least, checked_device, kv_memory, load_model_arg, mount_options


DEFAULT_RELOAD_S = 30.0  # a manifest GET or an attributes read per store: cheap enough to look often


def add_arguments(p):
    p.add_argument("store", nargs="+", help="store directories or URLs; clients name each by its basename")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("MILO_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default $MILO_API_KEY)")
    p.add_argument("--model", default="default",
                   help="model path, 'default', or synthetic:SHAPE (random weights, for load tests of stores "
                        "`milo bench --synthetic SHAPE` built); it must match every store")
    p.add_argument("--vllm", metavar="URL", default=None,
                   help="answer through the vLLM server at URL instead of milo's own engine: it must run the milo "
                        "connector over the same stores under the same names (docs/design.md, 'vLLM'); milo "
                        "retrieves and builds each prompt, vLLM batches, loads the prefix from the store and decodes")
    p.add_argument("--vllm-api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="with --vllm: the key vLLM was started with (its --api-key), sent as 'Authorization: Bearer "
                        "KEY' (default $VLLM_API_KEY)")
    p.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads; 1 is many times faster on a CPU shared with other jobs (default: torch's)")
    add_tier_arguments(p)
    p.add_argument("--device-cache", type=parse_size, default=0,
                   help="device memory kept for blocks' factors across requests, e.g. 2G (default 0: none)")
    p.add_argument("--kv-cache-memory", type=kv_memory, default=None, metavar="SIZE",
                   help="memory for the running rows' K/V: bytes (8G) or a share of the device memory free once the "
                        "model is loaded, less --device-cache (0.5); a row waits until its pages fit, a request that "
                        "cannot fit alone is a 400 (default 0.9 of it on a GPU, 0.5 on a CPU)")
    p.add_argument("--attention", choices=ATTENTIONS, default="auto",
                   help="flex: one FlexAttention call per layer for every row; rows: one SDPA call per row "
                        "(default auto: flex on a GPU, rows on a CPU)")
    p.add_argument("--shared-blocks", choices=("on", "off"), default="on",
                   help="on: a block the running rows place is held and rebuilt once for all of them, each row "
                        "attending it at its own offset; off: every row holds its own copy (the same answers; for "
                        "comparison; default on)")
    p.add_argument("--k", type=int, default=6, help="groups to retrieve per query unless a request says (default 6)")
    p.add_argument("--token-budget", type=int, default=None, help="default cap on retrieved tokens")
    p.add_argument("--recompute", type=int, default=0, metavar="N",
                   help="tokens at the start of each retrieved block the model computes again in the query's context, "
                        "unless a request says (closer to plain prompting, N×k more tokens per query; default 0)")
    p.add_argument("--on-load-error", choices=LOAD_ERROR_POLICIES, default=None,
                   help="a block that cannot be read (fails its checksum, or a read failed after retries): the model "
                        "computes it from the token ids the store keeps ('recompute', the default), or the requests "
                        "that need it fail with a 500 naming it ('fail'); other requests never notice")
    p.add_argument("--max-batch", type=int, default=16, help="rows in the running batch at most (default 16)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long an idle loop gathers a batch (default 5)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests at most; beyond, 503 (default 256)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help=f"request body limit (default {MAX_BODY_BYTES})")
    p.add_argument("--reload-interval", type=float, default=None, metavar="S",
                   help="how often to look for a store's new version (milo update, a rebuild) and swap it in without "
                        "failing a request; 0: only on POST /admin/reload (default 30; not with --vllm)")
    p.add_argument("--warmup", choices=WARMUP_MODES, default="auto",
                   help="before /health answers 200, run batches of 1, 2, 4, ... rows up to --max-batch (or "
                        "--warmup-rows) of each store's own demonstrations through prefill and decoding, so compiled "
                        "attention compiles its shapes before traffic: all, none, or auto (the default: only when "
                        "the attention is flex, since the per-row loop compiles nothing)")
    p.add_argument("--warmup-rows", type=int, default=None, metavar="N",
                   help="warm batches of at most N rows (default --max-batch)")
    p.add_argument("--drain-s", type=float, default=30.0, help="on SIGTERM, how long in-flight requests may finish")


def run(args) -> int:
    at_least(args, 1, "k", "token_budget", "max_batch", "max_queue", "max_body_bytes", "threads", "warmup_rows")
    at_least(args, 0, "recompute")
    if args.batch_wait_ms < 0 or args.drain_s < 0 or (args.reload_interval or 0) < 0:
        raise CommandError("--batch-wait-ms, --drain-s and --reload-interval cannot be negative")
    if not 0 <= args.port <= 65535:
        raise CommandError(f"--port must be between 0 and 65535; got {args.port}")
    try:  # the serve extra: not needed by the other commands, so imported here
        from ..runtime.engine import Engine
        from ..server.app import create_app
        from ..server.launch import mount_stores, serve, store_locations
    except ImportError as e:
        raise CommandError(f"milo serve needs the serve extra (pip install 'milo-kv[serve]'): {e}") from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    options = mount_options(args)
    settings = EngineSettings(k=args.k, token_budget=args.token_budget, recompute=args.recompute)
    if args.vllm:
        if args.recompute:
            raise CommandError("--recompute is milo's own engine's: vLLM loads a stored prefix as it is")
        if args.on_load_error:
            raise CommandError("--on-load-error is milo's own engine's: vLLM's policy is set where it starts "
                               "(python -m milo_infer.vllm.launch ... --load-failure recompute|fail)")
        if args.kv_cache_memory is not None or args.attention != "auto" or args.shared_blocks != "on":
            raise CommandError("--kv-cache-memory, --attention and --shared-blocks are milo's own engine's: vLLM "
                               "keeps its own KV cache, sized where it starts (--kv-cache-memory-bytes, "
                               "--gpu-memory-utilization)")
        if args.warmup == "all" or args.warmup_rows:
            raise CommandError("--warmup is milo's own engine's: vLLM compiles and captures its graphs where it starts")
        if args.reload_interval:
            raise CommandError("--reload-interval is milo's own engine's: vLLM's connector keeps the store versions "
                               "it mounted at its start (restart vLLM, then milo serve, to serve a new version)")
        from ..vllm.engine import VllmEngine, VllmUnavailable

        # only metadata, token ids and the BM25 index are read here: vLLM's connector reads the factors
        stores = mount_stores(args.store, **{**options, "tier": "disk"})
        try:
            engine = VllmEngine(args.vllm, stores, args.model, settings=settings, api_key=args.vllm_api_key or None)
        except VllmUnavailable as e:
            raise CommandError(str(e)) from None
    else:
        device = checked_device(args.device)
        stores = mount_stores(args.store, **options)
        loaded = load_model_arg(args.model, device)
        device = place_model(loaded, device)
        try:
            engine = Engine(loaded, stores, settings, device=device, device_cache_bytes=args.device_cache,
                            on_load_error=args.on_load_error or "recompute", max_rows=args.max_batch,
                            kv_cache_memory=args.kv_cache_memory, attention=args.attention,
                            shared_blocks=args.shared_blocks == "on")
        except ValueError as e:  # a setting the engine cannot run with (a KV budget too small for one page)
            raise CommandError(str(e)) from None
        print(f"milo serve: {engine.budget_summary()}", file=sys.stderr, flush=True)
    swap = {} if args.vllm else {
        "locations": store_locations(args.store), "open_store": lambda location: MiloStore.open(location, **options),
        "reload_interval_s": DEFAULT_RELOAD_S if args.reload_interval is None else args.reload_interval}
    warmup = None if args.vllm or not should_warm(args.warmup, engine.attention) else warming(
        engine, warm_sizes(args.max_batch, args.warmup_rows))
    app = create_app(engine, api_key=args.api_key or None, max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
                     max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, warmup=warmup, **swap)
    return serve(app, host=args.host, port=args.port, drain_s=args.drain_s)


def warming(engine, sizes: list[int]):
    """The start's warm-up (`milo_infer.server.warmup`), saying what it does and how long it took."""
    def warm() -> dict:
        print(f"milo serve: warming up ({engine.attention} attention): batches of {', '.join(map(str, sizes))} rows "
              f"per store; /health answers 503 until done", file=sys.stderr, flush=True)
        result = warm_engine(engine, sizes)
        print(f"milo serve: warmed up in {result['seconds']:.1f} s ({result['batches']} batches, {result['graphs']} "
              f"graphs compiled{', ' + str(len(result['failed'])) + ' batches failed' if result['failed'] else ''})",
              file=sys.stderr, flush=True)
        return result
    return warm
