"""Check a store's structure and the checksum of every array (each block, index and metadata array); exit non-zero naming each bad one."""
from tqdm import tqdm

from ..commandline import print_json
from ..errors import StoreCorruptedError
from ..store import MiloStore


def add_arguments(p):
    p.add_argument("path", help="store directory or URL (s3://bucket/prefix, gs://, az://, file://)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    try:
        store = MiloStore.open(args.path, tier="disk", verify=False)
    except StoreCorruptedError as e:  # damage the mount reads (ranks, checksums, chunk sizes): a finding, not a failed run
        problems, blocks = [str(e)], None
    else:
        with store, tqdm(total=store.num_blocks, unit="block", desc="verify", disable=None) as bar:
            problems = store.verify_all(progress=lambda i: bar.update())
        blocks = store.num_blocks
    if args.json:
        print_json({"path": args.path, "blocks": blocks, "ok": not problems, "problems": problems})
    else:
        for p in problems:
            print(p)
        counted = "" if blocks is None else f"{blocks} blocks, "
        print(f"{args.path}: {counted}" + ("OK" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0
