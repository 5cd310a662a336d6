"""Collect what no kept store version needs, and compact a version's dead bytes.

At a store URL: remove the versions the manifest names neither as current nor previous (--only-current:
the previous one too) and the chunk objects no kept version references, leaving anything younger than
--older-than seconds (a writer may still be uploading it). Then, for a URL or a directory of format 4:
when the current version's dead bytes (chunk bytes none of its blocks uses) are at least --compact-above
of its chunks' bytes, write a compacted version (docs/format.md, "Dead bytes").
"""
from ..commandline import print_json
from ..compaction import DEFAULT_THRESHOLD, compact
from ..errors import StoreError
from ..remote import gc
from ..report import human_bytes
from ..urls import is_url


def add_arguments(p):
    p.add_argument("location", help="store URL (s3://bucket/prefix, gs://, az://, file://) or store directory")
    p.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                   help="leave versions and chunks with objects younger than this (default 3600)")
    p.add_argument("--only-current", action="store_true",
                   help="remove the previous version too (what makes `milo update --remove` final; mounts of it "
                        "fail on their next read)")
    p.add_argument("--compact-above", type=float, default=DEFAULT_THRESHOLD, metavar="SHARE",
                   help=f"compact when dead bytes are at least this share of the chunks' bytes (default "
                        f"{DEFAULT_THRESHOLD}; 1 compacts only all-dead stores, 0 whenever there are any)")
    p.add_argument("--dry-run", action="store_true", help="report what would be removed or compacted, change nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    if args.older_than < 0:
        raise StoreError(f"--older-than must be at least 0; got {args.older_than}")
    if not 0 <= args.compact_above <= 1:
        raise StoreError(f"--compact-above is a share of the chunks' bytes, in [0, 1]; got {args.compact_above}")
    report = {}
    if is_url(args.location):
        report = gc(args.location, older_than=args.older_than, dry_run=args.dry_run,
                    keep_previous=not args.only_current)
    if report.get("current", True) is not None:  # a URL whose first writer never published has nothing to compact
        report["compaction"] = compact(args.location, args.compact_above, dry_run=args.dry_run)
    if args.json:
        print_json(report)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    if is_url(args.location):
        current = report["current"] or "none (no store published yet)"
        print(f"{report['url']}: current version {current}; {verb} {len(report['removed_versions'])} version(s), "
              f"{report['removed_chunks']} chunk(s), {report['removed_objects']} object(s) in all, "
              f"{human_bytes(report['removed_bytes'])}; kept {len(report['kept'])} version(s)")
        for v in report["unreadable_versions"]:
            print(f"kept every chunk: version {v}'s list of chunks cannot be read")
    c = report.get("compaction")
    if c is None:
        return 0
    print(f"{args.location}: dead bytes {human_bytes(c['dead_bytes'])} of {human_bytes(c['chunk_bytes'])} "
          f"({c['dead_share']:.1%}; compacting at {c['threshold']:.0%})" + (
              f": compacted, {c['blocks_rewritten']} block(s) written again ({human_bytes(c['bytes_rewritten'])}), "
              f"{c['chunks_dropped']} chunk(s) dropped, {human_bytes(c['reclaimed_bytes'])} reclaimed once the "
              "previous version is collected" if c["compacted"] else ""))
    return 0
