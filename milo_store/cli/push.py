"""Upload a local store to a store URL (s3://bucket/prefix, gs://, az://, file://), as a format-4 version."""
from ..blockcache import parse_size
from ..format import MAX_CHUNK_BYTES
from ..push import push


def add_arguments(p):
    p.add_argument("path", help="local store directory")
    p.add_argument("url", help="store URL to publish it at")
    p.add_argument("--force", action="store_true", help="replace the store the URL holds (if-match on its manifest)")
    p.add_argument("--chunk-size", type=parse_size, default=MAX_CHUNK_BYTES,
                   help=f"largest chunk object, whole blocks (default {MAX_CHUNK_BYTES >> 20}M)")


def run(args) -> int:
    print(push(args.path, args.url, force=args.force, max_chunk_bytes=args.chunk_size))
    return 0
