"""Whether demonstrations are gone from a store: what `milo-store verify --absent IDS` checks.

An update that removes demonstrations writes a version without their text, token ids and K/V: the
blocks that held them, or were encoded after them, are encoded again (docs/format.md, "Updates").
Without a model a store can show that much:

- no demonstration of the store has one of the ids;
- its BM25 index is exactly the index of the demonstrations it holds (built again and compared), so
  no removed text is indexed;
- the version holds nothing beyond its format's arrays and their chunks (no stray array, file or object),
  and its token ids are exactly its blocks' tokens;
- nothing else that could hold them is there: a URL's other versions (one that holds an id, or one that
  cannot be read, such as a killed writer's partial upload) and this machine's staging or upload folder
  for it; beside a directory, a killed writer's ``<path>.tmp-*`` or ``<path>.old-*`` or a staging.

Each finding is one line naming what holds what and how to remove it.
"""
import math
import warnings
from pathlib import Path

import numpy as np
import obstore
import zarr

from . import format as fmt, segments, text_index
from .errors import StoreError
from .remote import VERSIONS, MetadataStore, version_chunks
from .store import MiloStore
from .urls import local_sidecar, open_object_store

GC_HINT = "milo-store gc URL --only-current --older-than 0 removes it"


def absence_problems(location, ids: list[str]) -> list[str]:
    """Every finding that contradicts "none of ``ids`` is in the store at ``location``" (empty: absent)."""
    wanted = set(ids)
    with MiloStore.open(location, tier="disk", verify=False) as store:
        examples = store.examples()
        problems = [f"{store.path}: demonstration {i!r} is in the store (block {b})"
                    for i, b in zip(examples["id"], examples["block"]) if i in wanted]
        problems += segment_problems(store) if store.segmented else index_problems(store, examples)
        problems += stray_files(store)
        if fmt.TOKEN_IDS in store.group and store.group[fmt.TOKEN_IDS].shape[0] != int(store.block_tokens.sum()):
            problems.append(f"{store.path}: token_ids holds {store.group[fmt.TOKEN_IDS].shape[0]} ids, its blocks "
                            f"{int(store.block_tokens.sum())} tokens")
        if store.remote:
            problems += other_versions(store.path, store.version, wanted)
            problems += unreferenced_chunks(store.path)
        sidecars = ("staging", "upload") if store.remote else ("staging",)
        leftovers = [local_sidecar(store.path, kind) for kind in sidecars]
        if not store.remote:
            path = Path(store.path)
            leftovers += sorted(path.parent.glob(path.name + ".tmp-*")) + sorted(path.parent.glob(path.name + ".old-*"))
    problems += [f"{p}: a writer's leftover (staging, upload or replaced store) that may hold older bytes of "
                 f"{location}; remove it" for p in leftovers if p.is_file() or any(f.is_file() for f in p.rglob("*"))]
    return problems


def index_problems(store: MiloStore, examples: dict) -> list[str]:
    """The BM25 index must be the one the store's demonstrations give (a store without one indexes nothing)."""
    found = store.index_arrays(text_index.NAME, check=True)
    if found is None or not examples["input"]:
        return []
    expected = text_index.build_text_index(examples["input"], examples["block"], store.num_blocks)
    differ = [a for a in text_index.ARRAYS if a not in found[1] or not np.array_equal(found[1][a], expected[a])]
    extra = sorted(set(found[1]) - set(text_index.ARRAYS))
    if differ or extra:
        return [f"{store.path}: index {text_index.NAME} is not the index of the store's demonstrations "
                f"({', '.join(differ + extra)} differ): it may hold text the store no longer has"]
    return []


def segment_problems(store: MiloStore) -> list[str]:
    """A format-4 store's text must be exactly its demonstrations': the vocabulary the one they give, and
    each segment holding only its own demonstrations' text, token ids and postings, nothing beyond them."""
    problems = []
    inputs = []
    for k, (_, first, blocks, _, _) in enumerate(store.segment_table.tolist()):
        seg = store.segment(k)
        where = f"{store.path}: text segment {k}"
        known = {f"{x}_{part}" for x in segments.STRINGS for part in ("bytes", "starts")}
        known |= {"block_starts", "token_ids", *text_index.SEGMENT_ARRAYS}
        problems += [f"{where} holds an array {name} the format does not have: it may hold anything"
                     for name in sorted(set(seg.layout) - known)]
        for x in segments.STRINGS:
            if len(seg.array(f"{x}_bytes")) != int(seg.array(f"{x}_starts")[-1]):
                problems.append(f"{where}: {x} holds bytes beyond its demonstrations' text: they may hold anything")
        text = seg.strings("input")
        inputs += text
        expected = text_index.segment_postings(text)
        differ = [a for a in text_index.SEGMENT_ARRAYS if not np.array_equal(seg.array(a), expected[a])]
        if differ:
            problems.append(f"{where}'s postings are not those of its demonstrations ({', '.join(differ)} differ): "
                            "they may index text the store no longer has")
        if seg.has("token_ids") and len(seg.array("token_ids")) != int(store.block_tokens[first:first + blocks].sum()):
            problems.append(f"{where} holds {len(seg.array('token_ids'))} token ids, its blocks "
                            f"{int(store.block_tokens[first:first + blocks].sum())} tokens")
    found = store.index_arrays(text_index.NAME, check=True)
    if found is not None and inputs:
        arrays, attrs = text_index.vocabulary(inputs)
        differ = [a for a in text_index.VOCABULARY_ARRAYS if a not in found[1] or not np.array_equal(found[1][a], arrays[a])]
        differ += [a for a in ("documents", "total_length") if found[0].get(a) != attrs[a]]
        differ += sorted(set(found[1]) - set(text_index.VOCABULARY_ARRAYS))
        if differ:
            problems.append(f"{store.path}: index {text_index.NAME}'s vocabulary is not the one of the store's "
                            f"demonstrations ({', '.join(differ)} differ): it may hold text the store no longer has")
    return problems


def known_array(name: str) -> bool:
    """Whether the format has an array at this path inside a store."""
    parts = name.split("/")
    return (name in (fmt.FACTORS,) + fmt.CHECKED_ARRAYS
            or (len(parts) == 3 and parts[0] == fmt.INDEXES and parts[1] == text_index.NAME
                and parts[2] in text_index.ARRAYS + text_index.VOCABULARY_ARRAYS))


def expected_files(group) -> tuple[set[str], list[str]]:
    """(every file the format's nodes of ``group`` may have: metadata and chunk keys; the nodes it does not know)."""
    files, unknown = {"zarr.json"}, []
    with warnings.catch_warnings():  # a format-4 directory's chunks/ folder is not a zarr node, by design
        warnings.filterwarnings("ignore", message="Object at chunks is not recognized")
        members = list(group.members(max_depth=None))
    for name, node in members:
        files.add(f"{name}/zarr.json")
        if isinstance(node, zarr.Group):
            if name not in (fmt.EXAMPLES, fmt.INDEXES, f"{fmt.INDEXES}/{text_index.NAME}"):
                unknown.append(name)
            continue
        if not known_array(name):
            unknown.append(name)
        grid = [math.ceil(s / c) if s else 0 for s, c in zip(node.shape, node.chunks)]
        files.update(f"{name}/c/" + "/".join(map(str, k)) for k in np.ndindex(*grid))
    return files, unknown


def stray_files(store: MiloStore) -> list[str]:
    """Arrays, groups, files or objects of the version that are not the format's (they could hold anything)."""
    allowed, unknown = expected_files(store.group)
    if store.segmented and not store.remote:  # a directory's chunks are its own files; a URL's lie outside versions
        allowed |= set(store.placement.names)
    if store.remote:
        root = f"{VERSIONS}/{store.version}/"
        listed = [o["path"] for batch in obstore.list(open_object_store(store.path), prefix=root) for o in batch]
        present = [p.removeprefix(root) for p in listed]
    else:
        present = [f.relative_to(store.path).as_posix() for f in Path(store.path).rglob("*") if f.is_file()]
    problems = [f"{store.path}: {name} is not an array or group of the format: it may hold anything" for name in unknown]
    problems += [f"{store.path}: {p} is not a file of the store's arrays: it may hold anything"
                 for p in sorted(set(present) - allowed)]
    return problems


def unreferenced_chunks(url: str) -> list[str]:
    """A URL's chunk objects (format 4) that no version references: a killed writer's upload, or bytes of
    versions gc removed, which may hold anything until gc collects them."""
    store = open_object_store(url)
    versions = sorted({o["path"].split("/")[1] for batch in obstore.list(store, prefix=f"{VERSIONS}/") for o in batch})
    referenced = set()
    for version in versions:
        referenced |= version_chunks(store, url, version) or set()
    chunks = [o["path"] for batch in obstore.list(store, prefix=f"{fmt.CHUNKS}/") for o in batch]
    return [f"{url}: {key} is referenced by no version (a killed writer's upload, or what gc has yet to collect): "
            f"it may hold anything; {GC_HINT}" for key in sorted(chunks) if key.split("/", 1)[1] not in referenced]


def other_versions(url: str, current: str, wanted: set[str]) -> list[str]:
    """A URL's versions besides ``current`` that hold one of ``wanted``, or that cannot be read."""
    store = open_object_store(url)
    versions = sorted({o["path"].split("/")[1] for batch in obstore.list(store, prefix=f"{VERSIONS}/") for o in batch}
                      - {current})
    problems = []
    for version in versions:
        try:
            held = version_ids(store, url, version) & wanted
        except (StoreError, KeyError, FileNotFoundError, ValueError) as e:
            problems.append(f"{url}: version {version} cannot be read ({type(e).__name__}): it may hold anything "
                            f"(a killed writer's partial upload?); {GC_HINT}")
            continue
        if held:
            problems.append(f"{url}: version {version} still holds demonstration(s) "
                            f"{', '.join(map(repr, sorted(held)))}; {GC_HINT}")
    return problems


def version_ids(store, url: str, version: str) -> set[str]:
    """The demonstration ids another version of a URL holds (raises when it cannot be read)."""
    group = zarr.open_group(store=MetadataStore(store, url, version), path=f"{VERSIONS}/{version}", mode="r")
    meta = group.attrs.get(fmt.ATTRS_KEY)
    if not isinstance(meta, dict):
        raise KeyError(fmt.ATTRS_KEY)
    if meta.get("format_version", 0) < fmt.FORMAT_VERSION:
        return set(np.asarray(group[fmt.EXAMPLES]["id"][...]).tolist()) if fmt.EXAMPLES in group else set()
    with MiloStore.open(url, tier="disk", verify=False, version=version) as other:
        return set(other.example_array("id").tolist())
