"""Stores in object storage: versions under fresh prefixes, one manifest published by conditional write.

At a store URL, ``manifest.json`` names the current version; a version's objects (the same Zarr
group a local store holds) live under ``v/<version>/`` and never change once written. A writer
uploads a whole version first and publishes the manifest last, create-only when there was none and
if-match on the manifest it saw otherwise (``--force``, ``milo update``): of two racing writers exactly
one wins (the loser removes the version it uploaded), and a writer killed at any point leaves the
previous manifest, hence the previous version, in place. A format-4 version's blocks and text live in
immutable chunk objects under ``chunks/<id>``, outside every version, which versions reference: an update
uploads only the chunks it writes. Readers read the manifest once and pin its version for the life of
the mount. ``gc`` removes the versions no manifest names and the chunks no kept version references
(docs/format.md, "Stores in object storage").
"""
import hashlib
import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import obstore
import zarr
import zarr.storage

from . import format as fmt
from .errors import FormatVersionError, LostRaceError, NotAStoreError, StoreCorruptedError, StoreError
from .sources import ObjectChunks, one_line
from .urls import check_url, open_object_store, remote_timeout

MANIFEST, VERSIONS = "manifest.json", "v"
MANIFEST_FORMAT = 1
VERSION_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")  # one path segment: never "..", never a "/"
UPLOAD_CONCURRENCY = 8


@dataclass
class Manifest:
    version: str
    previous: str | None
    format_version: int
    e_tag: str | None


def remote_error(url: str, e: BaseException) -> StoreError:
    """One line naming the URL and what the object store said (no request dump, no credentials)."""
    text = str(e)
    if "NoSuchBucket" in text:
        return NotAStoreError(f"{url}: no such bucket")
    if isinstance(e, (obstore.exceptions.PermissionDeniedError, obstore.exceptions.UnauthenticatedError)) or any(
            s in text for s in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403 Forbidden")):
        return StoreError(f"{url}: access denied (check the credentials in the environment)")
    if "kind: Timeout" in text:  # connected (or not) but no reply in time: name the address that is silent
        request = re.search(r"performing \w+ (\S+)", text)
        where = f" from {request.group(1)}" if request else ""
        return StoreError(f"{url}: the object store is not answering: no reply{where} within {remote_timeout():g} s "
                          "(MILO_REMOTE_TIMEOUT sets the wait)")
    if "error sending request" in text or "Connection refused" in text or "dns error" in text:
        return StoreError(f"{url}: cannot reach the object store ({one_line(e)})")
    return StoreError(f"{url}: object store error ({one_line(e)})")


def read_manifest(url: str, store) -> Manifest | None:
    """The published manifest, or None when the URL holds none."""
    try:
        got = obstore.get(store, MANIFEST)
        body, e_tag = bytes(got.bytes()), got.meta.get("e_tag")
    except FileNotFoundError as e:
        if "NoSuchBucket" in str(e):
            raise remote_error(url, e) from None
        return None
    except Exception as e:
        raise remote_error(url, e) from None
    try:
        m = json.loads(body)
        if m.get("milo_manifest") != MANIFEST_FORMAT:
            raise FormatVersionError(f"{url}: manifest format {m.get('milo_manifest')!r}; this milo reads {MANIFEST_FORMAT}")
        if not VERSION_ID.fullmatch(str(m["version"])):
            raise ValueError(f"version {m['version']!r} is not a version id")
        return Manifest(str(m["version"]), m.get("previous"), m["format_version"], e_tag)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreCorruptedError(f"{url}: unreadable {MANIFEST} ({type(e).__name__}: {e})") from None


class MetadataStore(zarr.storage.ObjectStore):
    """zarr's ObjectStore, with object-store failures turned into one-line StoreErrors naming the URL
    (zarr already maps a missing key to None). Metadata is read lazily (examples, anchor), so a link
    failure can surface after the mount too; so can the removal of the pinned version (``gc``), which
    would otherwise read as arrays that are simply absent."""

    def __init__(self, store, url: str, version: str):
        super().__init__(store, read_only=True)
        self.url, self.version = url, version

    async def get(self, key, prototype, byte_range=None):
        try:
            found = await super().get(key, prototype, byte_range)
        except Exception as e:
            raise remote_error(self.url, e) from None
        if found is None:
            await self._check_version_kept()
        return found

    async def exists(self, key: str) -> bool:
        try:
            found = await super().exists(key)
        except Exception as e:
            raise remote_error(self.url, e) from None
        if not found:
            await self._check_version_kept()
        return found

    async def _check_version_kept(self) -> None:
        """A key is missing: fine if the version never had it, an error if the version itself is gone
        (a version's objects never change, so its root metadata goes only when the version is removed)."""
        try:
            kept = await super().exists(f"{VERSIONS}/{self.version}/zarr.json")
        except Exception as e:
            raise remote_error(self.url, e) from None
        if not kept:
            raise StoreError(f"{self.url}: version {self.version}, which this mount pinned, was removed "
                             "(milo-store gc after a replace); open the store again")


def cache_key(url: str, version: str | None) -> str:
    """A directory name in the block cache: of one store version (format ≤ 3, whose entries are block
    indices), or of every version of the store (``version`` None: format 4, entries named by chunk)."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return digest if version is None else f"{digest}-{version}"


def current_version(url: str) -> str:
    """The version the manifest names now."""
    url = check_url(url)
    manifest = read_manifest(url, open_object_store(url))
    if manifest is None:
        raise NotAStoreError(f"{url}: no milo store here (no {MANIFEST})")
    return manifest.version


def mount(url: str, version: str | None = None):
    """(URL, zarr group, milo attributes, origin factory, version id) of the version the manifest names now
    (or of ``version``, which must be one of the URL's)."""
    url = check_url(url)
    store = open_object_store(url)
    manifest = read_manifest(url, store)
    if manifest is None:
        raise NotAStoreError(f"{url}: no milo store here (no {MANIFEST})")
    if version is None:
        if problem := fmt.version_problem(manifest.format_version):
            raise FormatVersionError(f"{url}: {problem}")
        version = manifest.version
    elif not VERSION_ID.fullmatch(version):
        raise NotAStoreError(f"{url}: {version!r} is not a version id")
    root = f"{VERSIONS}/{version}"
    try:
        group = zarr.open_group(store=MetadataStore(store, url, version), path=root, mode="r")
        meta = group.attrs.get(fmt.ATTRS_KEY)
    except StoreError:
        raise
    except Exception as e:
        raise StoreCorruptedError(f"{url}: unreadable metadata of version {version} ({one_line(e)})") from None

    def make_origin(placement, checksums):
        try:
            return ObjectChunks(url, store, root, placement, checksums)
        except StoreError:
            raise
        except Exception as e:
            raise remote_error(url, e) from None

    return url, group, meta, make_origin, version


def new_version_id() -> str:
    """Sortable by creation time, unique across writers."""
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}Z-{secrets.token_hex(6)}"


class RemoteTarget:
    """The object-store end of a ``StoreWriter``: checks the URL when the writer starts, publishes at commit.

    ``replaces`` (an update) names the version the writer read: the manifest must still name it, and
    ``publish`` may copy objects from it.
    """

    def __init__(self, url: str, force: bool, replaces: str | None = None):
        self.url = check_url(url)
        self.store = open_object_store(self.url)
        self.previous = read_manifest(self.url, self.store)
        if self.previous is not None and not force:
            raise StoreError(f"{self.url} already holds a store; pass force=True (--force) to replace it")
        if replaces is not None and (self.previous is None or self.previous.version != replaces):
            now = self.previous.version if self.previous else "none"
            raise LostRaceError(f"{self.url}: the store changed since it was read (version {replaces} was read, "
                                f"the manifest now names {now}); nothing was written, run the update again")
        if self.previous is None:  # fail now, not after the build, on a bucket we cannot write
            try:
                probe = f"{VERSIONS}/.probe-{secrets.token_hex(6)}"
                obstore.put(self.store, probe, b"", mode="create")
                obstore.delete(self.store, probe)
            except Exception as e:
                raise remote_error(self.url, e) from None

    def publish(self, local_dir: Path, format_version: int) -> str:
        """Upload the finished local store as a new version, then publish its manifest (conditional): its
        chunk files (``chunks/<id>``, format 4) go to the URL's own ``chunks/``, where versions share them,
        first; every other file under ``v/<version>/``."""
        version = new_version_id()
        files = [p for p in Path(local_dir).rglob("*") if p.is_file()]
        keys = {p: p.relative_to(local_dir).as_posix() for p in files}
        chunks = [p for p in files if keys[p].startswith(fmt.CHUNKS + "/")]
        own = [p for p in files if p not in set(chunks)]

        def upload(p: Path):
            key = keys[p] if p in chunk_set else f"{VERSIONS}/{version}/{keys[p]}"
            obstore.put(self.store, key, p)

        chunk_set = set(chunks)
        try:
            with ThreadPoolExecutor(UPLOAD_CONCURRENCY) as pool:
                list(pool.map(upload, chunks))  # before the version that names them
                list(pool.map(upload, own))
        except Exception as e:
            raise remote_error(self.url, e) from None
        body = json.dumps({"milo_manifest": MANIFEST_FORMAT, "format_version": format_version, "version": version,
                           "previous": self.previous.version if self.previous else None,
                           "created": datetime.now(timezone.utc).isoformat()}, indent=1).encode()
        if self.previous is None:
            mode = "create"
        elif isinstance(self.store, obstore.store.LocalStore):  # no if-match on a file system: the writer's flock orders
            mode = "overwrite"
        else:
            mode = {"e_tag": self.previous.e_tag}
        try:
            obstore.put(self.store, MANIFEST, body, mode=mode)
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
            self._remove_version(version, [keys[p] for p in chunks])
            raise LostRaceError(f"{self.url}: another writer published a store here first; this writer lost the race "
                                f"and removed the version it had uploaded") from None
        except Exception as e:
            raise remote_error(self.url, e) from None
        return self.url

    def _remove_version(self, version: str, chunks: list[str]) -> None:
        """Delete what this writer uploaded (its version, the chunks it wrote): a lost race leaves nothing
        behind (gc collects it if this fails too)."""
        try:
            paths = [o["path"] for batch in obstore.list(self.store, prefix=f"{VERSIONS}/{version}/") for o in batch]
            winner = read_manifest(self.url, self.store)  # its chunks are never ours (ids are unique), but be sure
            kept = version_chunks(self.store, self.url, winner.version) if winner else set()
            paths += [] if kept is None else [c for c in chunks if c.split("/", 1)[1] not in kept]
            if paths:
                obstore.delete(self.store, paths)
        except Exception:  # the race is what the caller must hear about; gc removes an orphaned version later
            pass


def version_chunks(store, url: str, version: str) -> set[str] | None:
    """The chunk ids a version references (empty for format ≤ 3), checked against its recorded checksum;
    None when the version cannot be read (a partial upload) or its list fails its checksum."""
    try:
        group = zarr.open_group(store=MetadataStore(store, url, version), path=f"{VERSIONS}/{version}", mode="r")
        meta = group.attrs.get(fmt.ATTRS_KEY)
        if not isinstance(meta, dict) or meta.get("format_version", 0) < fmt.FORMAT_VERSION:
            return set() if isinstance(meta, dict) else None
        ids = group[fmt.CHUNK_IDS][...]
        if fmt.array_checksum(ids) != meta[fmt.ARRAY_CHECKSUMS][fmt.CHUNK_IDS]:
            return None
        return {str(i) for i in ids.tolist()}
    except Exception:  # unreadable, in whatever way: the caller must assume it may reference anything
        return None


def gc(url: str, older_than: float = 3600.0, dry_run: bool = False, keep_previous: bool = True) -> dict:
    """Delete the objects of versions the manifest names neither as current nor previous (nor as
    previous either, with ``keep_previous=False``: what makes an update's removals final), and the
    chunk objects (``chunks/``, format 4) no kept version references.

    A version or chunk with any object younger than ``older_than`` seconds is kept: it may be a writer's
    upload in progress. Objects outside ``v/`` and ``chunks/`` other than the manifest are not milo's and are
    left. A URL with neither a manifest nor versions holds no store: NotAStoreError. Versions without a
    manifest are the uploads of writers killed before the first publish, and are collected. Where the
    current or previous version's list of chunks cannot be read, no chunk is removed.
    """
    url = check_url(url)
    store = open_object_store(url)
    manifest = read_manifest(url, store)
    keep = {manifest.version, manifest.previous if keep_previous else None} - {None} if manifest else set()
    try:
        objects = [o for batch in obstore.list(store, prefix=f"{VERSIONS}/") for o in batch]
        chunks = [o for batch in obstore.list(store, prefix=f"{fmt.CHUNKS}/") for o in batch]
    except Exception as e:
        raise remote_error(url, e) from None
    if manifest is None and not objects and not chunks:  # most likely a mistyped prefix: say so
        raise NotAStoreError(f"{url}: no milo store here (no {MANIFEST} and no store versions)")
    by_version: dict[str, list] = {}
    for o in objects:
        by_version.setdefault(o["path"].split("/")[1], []).append(o)
    cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than)
    doomed = [v for v, objs in by_version.items()
              if v not in keep and all(o["last_modified"] <= cutoff for o in objs)]
    referenced, unknown = set(), []
    for v in sorted(set(by_version) - set(doomed)):
        found = version_chunks(store, url, v)
        if found is None and v in keep:
            unknown.append(v)
        referenced |= found or set()
    doomed_chunks = [] if unknown else [o for o in chunks if o["path"].split("/", 1)[1] not in referenced
                                        and o["last_modified"] <= cutoff]
    paths = [o["path"] for v in doomed for o in by_version[v]] + [o["path"] for o in doomed_chunks]
    if not dry_run and paths:
        try:
            obstore.delete(store, paths)
        except Exception as e:
            raise remote_error(url, e) from None
    return {"url": url, "current": manifest.version if manifest else None, "kept": sorted(set(by_version) - set(doomed)),
            "removed_versions": sorted(doomed), "removed_chunks": len(doomed_chunks),
            "removed_objects": len(paths), "unreadable_versions": unknown,
            "removed_bytes": sum(o["size"] for v in doomed for o in by_version[v]) + sum(o["size"] for o in doomed_chunks),
            "dry_run": dry_run}
