"""`milo`: build stores from demonstrations, query them, evaluate, benchmark and serve them. One
subcommand per module; what they share is here: the input error, the numeric flag checks, loading
--model, checking --device, the KV budget, and the flags that say how a store is mounted."""
import argparse

from milo_store.blockcache import BlockCache, parse_size
from milo_store.sources import MemoryCache

from ..runtime.devices import usable_device
from ..runtime.pages import parse_kv_memory
from ..models import load_model

SYNTHETIC = "synthetic:"  # --model synthetic:SHAPE: random weights of a named shape (milo_infer.bench.synthetic_model)


class CommandError(Exception):
    """Bad input to a subcommand: `main` prints the message as one line on stderr and exits 2."""


def at_least(args, minimum: int, *flags: str) -> None:
    """Each of ``flags`` (argparse attribute names) that was given must be at least ``minimum``: checked
    before any long work, the first one below it is a CommandError naming its flag."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < minimum:
            raise CommandError(f"--{flag.replace('_', '-')} must be at least {minimum}; got {value}")


def load_model_arg(spec: str, device=None, **options):
    """`load_model` of --model (``options``: its keywords); what a bad one raises (no such path, not a model
    folder, an unsupported model) becomes a CommandError naming the flag. ``synthetic:SHAPE`` is a Qwen2 of
    that shape with random weights and the byte-level tokenizer (what `milo bench --synthetic` builds its
    stores for), made on ``device`` in bf16 on a GPU, fp32 on a CPU: load tests of a model size without its
    files."""
    if str(spec).startswith(SYNTHETIC):
        from ..bench import synthetic_model

        shape = str(spec).removeprefix(SYNTHETIC)
        if shape not in synthetic_model.SHAPES:
            raise CommandError(f"--model {spec}: no such shape (shapes: {', '.join(sorted(synthetic_model.SHAPES))})")
        return synthetic_model.device_model(shape, device)
    try:
        return load_model(spec, **options)
    except (OSError, ValueError) as e:
        raise CommandError(f"--model: {e}") from None


def kv_memory(text: str) -> int | float:
    """--kv-cache-memory: bytes or a share of free memory (`parse_kv_memory`), an argparse error otherwise."""
    try:
        return parse_kv_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def checked_device(name: str | None):
    """--device as a device this torch can use, checked before a model loads (a CommandError if not)."""
    try:
        return usable_device(name)
    except ValueError as e:  # an unknown or absent device
        raise CommandError(f"--device {name}: {e}") from None


def add_tier_arguments(p) -> None:
    """Where a mounted store's factors are read from, and its caches (``milo query``, ``milo serve``)."""
    p.add_argument("--tier", choices=("host", "disk", "cached"), default="host",
                   help="where factors are read from: host (the whole store in memory), disk (each query reads its "
                        "blocks; for a store URL, range GETs behind the block cache), cached (disk behind an "
                        "in-memory LRU, --memory-cache-size)")
    p.add_argument("--memory-cache-size", type=parse_size, default=None,
                   help="--tier cached: the in-memory LRU's limit, e.g. 2G (default 1G)")
    p.add_argument("--cache-dir", default=None, help="this machine's block cache of store URLs (default ~/.cache/milo/blocks)")
    p.add_argument("--block-cache-size", "--cache-size", dest="cache_size", type=parse_size, default=None,
                   help="limit of the block cache of store URLs on this machine's disk, e.g. 10G "
                        "(default $MILO_CACHE_SIZE or 10G); does not size --tier cached")


def mount_options(args) -> dict:
    """`MiloStore.open`'s keywords from `add_tier_arguments`' flags: one block cache for every store, and
    for the cached tier one in-memory LRU, which every mount shares (a server's new versions of a store
    find the blocks they keep in it)."""
    if args.memory_cache_size is not None and args.tier != "cached":
        raise CommandError("--memory-cache-size sizes the cached tier's in-memory LRU; pass --tier cached with it")
    memory = {}
    if args.tier == "cached":
        memory = {"memory_cache": MemoryCache(args.memory_cache_size if args.memory_cache_size is not None else 1 << 30)}
    return {"tier": args.tier, "block_cache": BlockCache(args.cache_dir, args.cache_size), **memory}
