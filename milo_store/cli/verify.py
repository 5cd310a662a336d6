"""Check a store's structure and the checksum of every array (each block, index and metadata array); exit non-zero naming each bad one."""
from tqdm import tqdm

from ..absence import absence_problems
from ..commandline import id_list, print_json
from ..errors import StoreCorruptedError
from ..store import MiloStore


def add_arguments(p):
    p.add_argument("path", help="store directory or URL (s3://bucket/prefix, gs://, az://, file://)")
    p.add_argument("--absent", action="append", metavar="IDS",
                   help="also prove these demonstrations (comma-separated ids; repeatable) are gone: not in the "
                        "store, not in its index, in no other version or leftover (docs/format.md, \"Updates\")")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    absent = id_list(args.absent)
    try:
        store = MiloStore.open(args.path, tier="disk", verify=False)
    except StoreCorruptedError as e:  # damage the mount reads (ranks, checksums, chunk sizes): a finding, not a failed run
        problems, blocks = [str(e)], None
    else:
        with store, tqdm(total=store.num_blocks, unit="block", desc="verify", disable=None) as bar:
            problems = store.verify_all(progress=lambda i: bar.update())
        blocks = store.num_blocks
        if absent:
            problems += absence_problems(args.path, absent)
    if args.json:
        print_json({"path": args.path, "blocks": blocks, "ok": not problems, "problems": problems,
                    **({"absent": absent} if absent else {})})
    else:
        for p in problems:
            print(p)
        counted = "" if blocks is None else f"{blocks} blocks, "
        proven = f", {len(absent)} demonstration(s) absent" if absent and not problems else ""
        print(f"{args.path}: {counted}" + ("OK" + proven if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0
