"""Store URLs: which strings name an object store, and the obstore client for one.

``s3://bucket/prefix``, ``gs://…``, ``az://…`` (also ``azure://``, ``abfs://``), ``file:///abs/dir`` and
``memory://name`` (one in-process store per name, for tests) are object-store locations; anything else
is a plain path and keeps the local format. Credentials and endpoints come from the environment the
way the cloud SDKs read it (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL`` for S3-compatible servers,
``GOOGLE_*``, ``AZURE_*``); plain HTTP is allowed only when asked for with ``AWS_ALLOW_HTTP=true``.
Requests are retried with exponential backoff on 5xx, timeouts and dropped connections
(``MILO_REMOTE_RETRIES``, default 4, and ``MILO_REMOTE_TIMEOUT`` seconds per request, default 30).
"""
import hashlib
import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from obstore.store import MemoryStore, from_url

from .errors import StoreError

SCHEMES = ("s3", "gs", "az", "azure", "abfs", "file", "memory")
_memory_stores: dict[str, MemoryStore] = {}


def is_url(location) -> bool:
    """Whether ``location`` names an object store rather than a local path."""
    return isinstance(location, str) and "://" in location and location.split("://", 1)[0] in SCHEMES


def check_url(url: str) -> str:
    """The URL without a trailing slash; a one-line StoreError for one that names no store location."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise StoreError(f"{url}: unsupported store URL scheme {parts.scheme!r}; expected one of {SCHEMES}")
    if parts.scheme not in ("file", "memory") and not parts.netloc:
        raise StoreError(f"{url}: a store URL names a bucket or container, e.g. {parts.scheme}://bucket/prefix")
    if parts.query or parts.fragment:
        raise StoreError(f"{url}: store URLs take no query or fragment; configure the client through the environment")
    return url.rstrip("/")


def cache_home() -> Path:
    """``$MILO_CACHE`` or ``~/.cache/milo``: this machine's milo files (models, block cache, locks)."""
    return Path(os.environ.get("MILO_CACHE", Path.home() / ".cache" / "milo"))


def local_sidecar(location, kind: str) -> Path:
    """A local path beside a store for a writer's own files (``kind``: "staging", "lock"):
    ``<path>.<kind>`` for a directory, ``cache_home()/<kind>/<hash of the URL>`` for a URL."""
    if is_url(location):
        return cache_home() / kind / hashlib.sha256(check_url(location).encode()).hexdigest()[:24]
    return Path(f"{location}.{kind}")


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise StoreError(f"{name}={os.environ[name]!r} is not a number") from None


def remote_timeout() -> float:
    """Seconds one object-store request may take, reply and body (``MILO_REMOTE_TIMEOUT``, default 20)."""
    return _env_float("MILO_REMOTE_TIMEOUT", 20.0)


def open_object_store(url: str):
    """The obstore client rooted at ``url`` (its prefix), with milo's timeouts and retries."""
    url = check_url(url)
    scheme = url.split("://", 1)[0]
    if scheme == "memory":
        return _memory_stores.setdefault(url, MemoryStore())
    if scheme == "file":
        path = urlsplit(url).path
        os.makedirs(path, exist_ok=True)
        return from_url(url)
    timeout = remote_timeout()
    connect = _env_float("MILO_REMOTE_CONNECT_TIMEOUT", 5.0)
    retries = int(_env_float("MILO_REMOTE_RETRIES", 4))
    client = {"connect_timeout": timedelta(seconds=min(timeout, connect)), "timeout": timedelta(seconds=timeout),
              "allow_http": os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true"}
    # Retries (5xx, resets) start only within one timeout of the first attempt: an endpoint that accepts
    # connections but never answers is reported after one or two timeouts, not after every retry's.
    retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=timeout),
             "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=2), "base": 2}}
    return from_url(url, client_options=client, retry_config=retry)
