"""Remove the objects of store versions no manifest names (object-store URLs only).

Keeps the version the manifest names and the one it replaced (unless --only-current), and any version
with an object younger than --older-than seconds (a writer may still be uploading it).
"""
from ..commandline import print_json
from ..errors import StoreError
from ..remote import gc
from ..report import human_bytes
from ..urls import is_url


def add_arguments(p):
    p.add_argument("url", help="store URL (s3://bucket/prefix, gs://, az://, file://)")
    p.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                   help="leave versions with objects younger than this (default 3600)")
    p.add_argument("--only-current", action="store_true",
                   help="remove the previous version too (what makes `milo update --remove` final; mounts of it "
                        "fail on their next read)")
    p.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    if not is_url(args.url):
        raise StoreError(f"{args.url}: gc works on store URLs; a local store keeps no old versions")
    if args.older_than < 0:
        raise StoreError(f"--older-than must be at least 0; got {args.older_than}")
    report = gc(args.url, older_than=args.older_than, dry_run=args.dry_run, keep_previous=not args.only_current)
    if args.json:
        print_json(report)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    current = report["current"] or "none (no store published yet)"
    print(f"{report['url']}: current version {current}; {verb} {len(report['removed_versions'])} version(s), "
          f"{report['removed_objects']} object(s), {human_bytes(report['removed_bytes'])}; kept {len(report['kept'])}")
    return 0
