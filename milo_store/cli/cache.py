"""This machine's block cache of remote stores: `stat` (size, files; --verify checks every file) or `clear`."""
from ..blockcache import BlockCache, parse_size
from ..commandline import print_json
from ..report import human_bytes


def add_arguments(p):
    p.add_argument("action", choices=("stat", "clear"), help="stat: what the cache holds; clear: remove its entries (only in a directory the cache marked as its own)")
    p.add_argument("--cache-dir", default=None, help="cache directory (default: ~/.cache/milo/blocks, or $MILO_CACHE/blocks)")
    p.add_argument("--cache-size", type=parse_size, default=None, help="size limit to report, e.g. 10G (default: the limit the cache was last filled under, else $MILO_CACHE_SIZE or 10G)")
    p.add_argument("--verify", action="store_true", help="stat: check every file against the checksum in its name")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    cache = BlockCache(args.cache_dir, args.cache_size)
    if args.action == "clear":
        files, removed_bytes = cache.clear()
        info = {"dir": str(cache.dir), "removed_files": files, "removed_bytes": removed_bytes}
        print_json(info) if args.json else print(f"{info['dir']}: removed {info['removed_files']} files, "
                                                 f"{human_bytes(info['removed_bytes'])}")
        return 0
    info = cache.stat()
    if args.verify:
        info["bad_files"] = cache.check()
    if args.json:
        print_json(info)
    else:
        print(f"{info['dir']}: {info['files']} blocks of {info['stores']} store version(s), "
              f"{human_bytes(info['bytes'])} of {human_bytes(info['limit_bytes'])} ({info['limit_source']} limit)")
        for bad in info.get("bad_files", []):
            print(f"bad: {bad}")
    return 1 if info.get("bad_files") else 0
