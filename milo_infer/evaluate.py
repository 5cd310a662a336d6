"""Accuracy and KV bytes of each storage method on held-out queries (issue: `milo eval`).

Three pieces:

* `method_config` reads a method name into a store configuration: a base — ``full`` (the
  uncompressed baseline: identity codec, fp16), ``milo`` (SVD at ratio ρ, entropy allocation per
  head), the paper's two baselines at the same measured bytes, ``global-proj`` (one corpus-wide
  projection per layer, K/V and head) and ``example-svd`` (every demonstration factored alone) — then
  modifiers (``-fullrank`` keeps every direction, isolating the codec's rounding from the
  truncation; allocation policy, scope, K/V split, ``-ks<share>``) and a quantization (``+int8``,
  ``+int4``, ``+kivi``).
* `encode_once` builds every method's store for one (corpus, block size, context blocks) while
  running the model over the demonstrations once. The expensive part of a build is the encoding;
  `build_store` stages full-rank factors under a fingerprint that leaves out the ratio, policy,
  scope, dtype and full_rank flag, so stores that differ only in those share one staging. The staged
  codec is in the fingerprint (identity factors are not SVD factors; the baselines are computed from
  the SVD staging, `staging_codec`), but an identity staging holds the
  block's exact fp32 K/V, so the SVD staging is factored from it instead of encoding again.
* `evaluate` answers test queries from one store, scores them and measures the bytes each query
  streamed. Every finished prediction is appended to a JSONL file, so a killed run resumes.

`write_tables` renders the collected rows as a methods × datasets table (the shape of the MILO
paper's Table 1) in markdown and JSON. Bytes are always measured from the stores
(`MiloStore.accounting`, the factor bytes each query read), never computed from a formula.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import statistics
from pathlib import Path
from typing import Callable

from milo_store import CompressionConfig, MiloStore, Staging, StoreError, factorize_block
from milo_store.compress import allocation_record, staging_codec

from .build import PAPER_ALLOCATION, BuildConfig, build_store, corpus_fingerprint, default_compression
from .corpus import Demonstration, TaskSpec
from .models import LoadedModel
from .scoring import is_correct
from .session import MAX_NEW_TOKENS, MiloSession

# A method name is a base, a quantization, then modifiers: ``base(+quant)?(-modifier)*``, e.g.
# ``milo``, ``milo-energy``, ``milo+int8-ks0.3``, ``full+kivi``. Each part sets CompressionConfig
# fields; the ratio comes from the run unless the method fixes it (``full``, ``-fullrank``). One
# store has one name: modifiers come in the order below, at most one of each kind, and none that
# restates a default.
BASES = {
    "full": {"codec": "identity", "ratio": 1.0},  # the uncompressed baseline (identity codec)
    # plain KV quantization: every unit's K/V itself in the quantization's format (docs/format.md, raw
    # segments), no factors; its ratio is the format's (raw+int8 ~0.5, raw+int4 ~0.3, raw+kivi ~0.19)
    "raw": {"codec": "raw", "ratio": 1.0},
    "milo": {"codec": "svd"},
    # the paper's baselines at equal measured bytes (milo_store/baselines.py)
    "global-proj": {"codec": "global-proj"},
    "example-svd": {"codec": "example-svd"},
    "example-asvd": {"codec": "example-svd", "query_aware": True},  # activation-aware, as ASVD
}
# KIVI-style groups (keys per channel in groups of 32 tokens, values per token). ``raw+kivi`` is KIVI's
# 2-bit quantization of the K/V (pre-RoPE); ``full+kivi`` the same grouping on an identity store's A = X,
# which also stores B = I per segment (d² bytes).
QUANTS = {"int8": "int8", "int4": "int4", "kivi": "int2"}
PLAIN_BASES = ("full", "raw")  # no allocation to modify: every unit is stored whole
MODIFIERS = {  # word -> (kind, fields); kinds in canonical order
    "fullrank": ("fullrank", {"full_rank": True, "ratio": 1.0}),  # every direction: the codec's rounding alone
    # entropy is the default; frontier chooses low rank or raw per unit (milo_store/allocation.py)
    **{p: ("policy", {"policy": p}) for p in ("energy", "uniform", "random", "frontier")},
    **{s: ("scope", {"scope": s}) for s in ("layer", "global")},  # head is the default
    "shared": ("split", {"kv_split": "shared"}),  # one budget for K and V instead of half each
    "ks": ("split", None),  # ks<share>: the keys' share of a separate budget, e.g. ks0.3
    "qaw": ("qaw", {"query_aware": True}),  # SVD of X diag(s): channels weighted by what their error costs
}
KINDS = list(dict.fromkeys(kind for kind, _ in MODIFIERS.values()))
EXAMPLES = ("full", "default", "raw+int8", "raw+kivi", "milo", "milo-fullrank", "milo-energy", "milo-layer",
            "milo-ks0.3", "milo+int8", "milo+int4", "milo+kivi", "milo+int8-qaw", "milo+int8-frontier-qaw",
            "global-proj", "example-svd", "example-asvd")
DEFAULT = "default"  # whatever `milo build` writes at the run's ratio (`default_method`)


@functools.cache
def method_fields(name: str) -> dict:
    """The CompressionConfig fields a method name stands for (ValueError naming the bad part)."""
    base = max((b for b in BASES if name == b or name.startswith((b + "-", b + "+"))), key=len, default=None)
    if base is None:
        raise ValueError(f"unknown method {name!r}: it must start with one of {', '.join(BASES)}")
    fields, rest = dict(BASES[base]), name[len(base):]
    parts = re.findall(r"([+-])([^+-]+)", rest)
    if "".join(sign + word for sign, word in parts) != rest:
        raise ValueError(f"unknown method {name!r}: cannot read {rest!r}")
    quant, mods = [w for sign, w in parts if sign == "+"], [w for sign, w in parts if sign == "-"]
    if len(quant) > 1:
        raise ValueError(f"unknown method {name!r}: one quantization per method")
    if quant and quant[0] not in QUANTS:
        raise ValueError(f"unknown method {name!r}: +{quant[0]} is not a quantization ({', '.join(QUANTS)})")
    if quant:
        fields["dtype"] = QUANTS[quant[0]]
    kinds = []
    for word in mods:
        share = re.fullmatch(r"ks(0\.\d*[1-9])", word)
        if base in PLAIN_BASES or (word not in MODIFIERS and not share) or word == "ks":
            raise ValueError(f"unknown method {name!r}: -{word} is not a modifier of {base}"
                             + ("" if base in PLAIN_BASES else f" (known: {', '.join(w for w in MODIFIERS if w != 'ks')}, ks<share>)"))
        kind, extra = MODIFIERS["ks" if share else word]
        fields.update(extra or {"key_share": float(share.group(1))})
        kinds.append(kind)
    canonical = base + "".join("+" + q for q in quant) + "".join(
        "-" + w for w in sorted(mods, key=lambda w: KINDS.index(MODIFIERS["ks" if w.startswith("ks") else w][0])))
    if len(set(kinds)) < len(kinds) or canonical != name:
        raise ValueError(f"method {name!r}: write it as {canonical!r} (one name per store)" if canonical != name else
                         f"method {name!r}: at most one modifier of each kind ({', '.join(KINDS)})")
    return fields


def default_method(ratio: float) -> str:
    """The method name of what `milo build` writes by default at ``ratio`` (dtype, allocation, weighting)."""
    c = default_compression(ratio)
    quant = {dtype: word for word, dtype in QUANTS.items()}[c.dtype]
    # policy, scope and split away from the paper's (the names' defaults), in the canonical order; their
    # values are the modifier words
    modifiers = [getattr(c, field) for field, paper in PAPER_ALLOCATION.items() if getattr(c, field) != paper]
    return f"milo+{quant}" + "".join(f"-{m}" for m in modifiers) + "-qaw"


def resolve(method: str, ratio: float) -> str:
    """The concrete method a name stands for at ``ratio``: ``default`` becomes `default_method`."""
    return default_method(ratio) if method == DEFAULT else method


def method_config(name: str, ratio: float, seed: int = 0) -> CompressionConfig:
    """The store configuration a method name stands for (fp16 factors unless the method quantizes)."""
    return CompressionConfig(**{"ratio": ratio, "seed": seed, "dtype": "float16",
                                **method_fields(resolve(name, ratio))})


def fixed_ratio(method: str) -> bool:
    """Whether the method's store is the same at every ratio (full, raw, -fullrank)."""
    return method != DEFAULT and "ratio" in method_fields(method)


def store_name(method: str, ratio: float) -> str:
    """Directory name of a method's store: the ratio is part of it only where it changes the store.
    ``default`` shares the store of the method it stands for."""
    method = resolve(method, ratio)
    return method if fixed_ratio(method) else f"{method}-r{ratio:g}"


# --- building ------------------------------------------------------------------------------------

def encode_once(loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, base: BuildConfig,
                stores: dict[str, CompressionConfig], root, *, progress: bool = True) -> dict[str, dict]:
    """Build each named store under ``root`` from one encoding; returns each one's build summary.

    A store already at its path built the same way (demonstrations, blocks, allocation, model) is
    kept as is. Each codec's
    staged factors live in ``root/staging-<fingerprint hash>``; a build gets hard links to them in
    its own ``<store>.staging`` (what `build_store` reads and resumes from), and whatever it encodes
    is linked back, even when it is interrupted. Staged files are only ever replaced whole
    (`Staging.put` renames), so sharing them by links is safe. Identity stores are built first so
    that the SVD staging can be factored from their K/V (`_factor_staged`).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name, compression in sorted(stores.items(), key=lambda item: item[1].codec != "identity"):
        out = root / name
        config = dataclasses.replace(base, compression=compression)
        existing = _existing_summary(out, loaded, demos, config)
        if existing is not None:
            summaries[name] = existing
            continue
        fingerprint = corpus_fingerprint(loaded.identity, task, demos, config)
        shared = _staging_dir(root, fingerprint)
        if staging_codec(compression.codec) == "svd":
            _factor_staged(root, fingerprint)
        own = Path(f"{out}.staging")
        if shared.is_dir():
            _link_missing(shared, own)
        try:
            summaries[name] = build_store(out, loaded, demos, task, config, force=True, progress=progress,
                                          keep_staging=True)
        finally:
            if own.is_dir():
                _link_missing(own, shared)
                shutil.rmtree(own)
    return {name: summaries[name] for name in stores}


def _staging_dir(root: Path, fingerprint: dict) -> Path:
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return root / f"staging-{digest[:16]}"


def _factor_staged(root: Path, fingerprint: dict) -> None:
    """Stage SVD factors of every block an identity staging of the same encoding holds.

    Identity factors are A = X (the block's fp32 K/V as encoded), so this is the factorisation
    `build_store` would stage after running the model again, without running it.
    """
    source_fp = {**fingerprint, "codec": "identity"}
    source_dir = _staging_dir(root, source_fp)
    if not source_dir.is_dir():
        return
    source, target = Staging(source_dir, source_fp), Staging(_staging_dir(root, fingerprint), fingerprint)
    for f in sorted(source_dir.glob("block_*.safetensors")):
        i = int(f.stem.removeprefix("block_"))
        if not target.has(i):
            x = source.get(i).A  # [L, 2, H, T, d]
            target.put(i, factorize_block(x[:, 0], x[:, 1], codec="svd"))


def _link_missing(src: Path, dst: Path) -> None:
    """Hard-link every finished file of ``src`` that ``dst`` lacks (temporaries start with a dot)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(".") and not (dst / f.name).exists():
            os.link(f, dst / f.name)


def _existing_summary(out: Path, loaded: LoadedModel, demos: list[Demonstration], config: BuildConfig) -> dict | None:
    """The accounting of a finished store at ``out`` built the same way, else None (rebuild it)."""
    try:
        with MiloStore.open(out, tier="disk", verify=False) as store:
            build = store.meta.get("build", {})
            same = (allocation_record(store.meta.get("allocation")) == allocation_record(config.compression)
                    and store.meta.get("model", {}).get("config_hash") == loaded.identity["config_hash"]
                    and [build.get(f) for f in ("block_size", "context_blocks", "order", "seed")]
                    == [config.block_size, config.context_blocks, config.order, config.seed]
                    and sorted(store.examples()["id"]) == sorted(d.id for d in demos))
            acc, blocks = store.accounting(), store.num_blocks
    except StoreError:
        return None
    if not same:
        return None
    return {"store": str(out), "blocks": blocks, "blocks_encoded_now": 0, "reused": True,
            "full_fp16_bytes": acc["full_fp16_bytes"], "stored_bytes": acc["total_bytes"],
            "disk_bytes": acc["disk_bytes"], "ratio": acc["ratio"]}


# --- answering -----------------------------------------------------------------------------------

def evaluate(loaded: LoadedModel, store_path, test: list[Demonstration], task: TaskSpec, k: int = 6,
             n: int | None = None, *, predictions=None, max_new_tokens: int = MAX_NEW_TOKENS,
             on_answer: Callable[[dict], None] | None = None) -> dict:
    """Answer the first ``n`` test items from the store; accuracy, bytes and time per stage.

    ``predictions`` (a JSONL path) keeps one line per finished item; items already there are not
    asked again. Its lines carry a key of the store's allocation and ``k``: lines from another
    store or another k raise rather than mix into this result.
    """
    items = test if n is None else test[:n]
    if not items:
        raise ValueError("no test items to evaluate")
    with MiloStore.open(store_path, tier="host") as store:
        key = _run_key(store, k, max_new_tokens if task.answer_kind != "label" else MAX_NEW_TOKENS)
        done = _read_predictions(predictions, key) if predictions is not None else {}
        session = None
        for item in items:
            if item.id in done:
                continue
            session = session or MiloSession(loaded, store, k=k, max_new_tokens=max_new_tokens)
            answer = session.answer(item.input)
            reference = task.answer_of(item.output) or item.output
            record = {"key": key, "id": item.id, "input": item.input, "reference": reference,
                      "prediction": answer.text, "correct": is_correct(answer.text, reference, task.answer_kind),
                      "blocks": answer.blocks, "groups": answer.groups, "kv_bytes_full": answer.kv_bytes_full,
                      "kv_bytes_stored": answer.kv_bytes_stored, "seconds": answer.seconds}
            done[item.id] = record
            if predictions is not None:
                with open(predictions, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            if on_answer is not None:
                on_answer(record)
        acc = store.accounting()
    records = [done[item.id] for item in items]
    stages = {}
    for r in records:
        for stage, s in r["seconds"].items():
            stages[stage] = stages.get(stage, 0.0) + s
    return {"accuracy": sum(r["correct"] for r in records) / len(records), "n": len(records),
            "query_kv_bytes_stored": statistics.fmean(r["kv_bytes_stored"] for r in records),
            "query_kv_bytes_full": statistics.fmean(r["kv_bytes_full"] for r in records),
            "store_bytes": acc["total_bytes"], "store_full_fp16_bytes": acc["full_fp16_bytes"],
            "store_ratio": acc["ratio"], "seconds": stages, "answers": {r["id"]: r["prediction"] for r in records}}


def agreement(answers: dict, reference: dict) -> float | None:
    """Share of the items both answered on which ``answers`` equal ``reference``'s (None if none shared)."""
    shared = answers.keys() & reference.keys()
    return sum(answers[i] == reference[i] for i in shared) / len(shared) if shared else None


def _run_key(store: MiloStore, k: int, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """What a logged answer depends on besides the question (a non-default free-form answer length
    is added only when set, so logs written before it existed keep their key)."""
    what = {"allocation": allocation_record(store.meta.get("allocation")), "build": store.meta.get("build"),
            "model": store.meta.get("model", {}).get("config_hash"), "k": k}
    if max_new_tokens != MAX_NEW_TOKENS:
        what["max_new_tokens"] = max_new_tokens
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _read_predictions(path, key: str) -> dict[str, dict]:
    """Finished records by item id. A torn last line (a killed write) is dropped and rewritten."""
    path = Path(path)
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    done = {}
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                path.write_text("".join(x + "\n" for x in lines[:-1]), encoding="utf-8")
                break
            raise ValueError(f"{path}:{number}: not a JSON line; delete the file to start over") from None
        if record.get("key") != key:
            raise ValueError(f"{path}:{number}: made from another store, k or --max-new-tokens; "
                             f"delete the file to start over")
        done[record["id"]] = record
    return done


# --- results table -------------------------------------------------------------------------------

def write_tables(rows: list[dict], out, *, header: str = "") -> tuple[Path, Path]:
    """``results.json`` (every row) and ``results.md`` (accuracy, methods × datasets) under ``out``.

    A row is one (dataset, seed, block size, method, ratio) with `evaluate`'s fields (its answers
    summarised as ``agreement``). A table row is a method, labelled with its ratio and block size where
    the rows hold several; a cell is the mean accuracy over seeds (± the standard deviation when there
    are several), then in brackets the mean share of answers equal to ``full``'s on the same items
    where a row has one. The bytes columns are the stores' measured size over the fp16 K/V of the
    same tokens, and the mean bytes a query streamed.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(_label(r, rows) for r in rows))
    lines = [header] if header else []
    lines += ["| Method | " + " | ".join(datasets) + " | Avg. | Store / full fp16 | Query KV read (mean) |",
              "|---" * (len(datasets) + 4) + "|"]
    for m in methods:
        mine = [r for r in rows if _label(r, rows) == m]
        cells, means = [], []
        for d in datasets:
            accs = [100 * r["accuracy"] for r in mine if r["dataset"] == d]
            agree = [100 * r["agreement"] for r in mine if r["dataset"] == d and r.get("agreement") is not None]
            if accs:
                means.append(statistics.fmean(accs))
                spread = f" ± {statistics.stdev(accs):.1f}" if len(accs) > 1 else ""
                agreed = f" [{statistics.fmean(agree):.0f}%]" if agree else ""
                cells.append(f"{means[-1]:.1f}{spread}{agreed}")
            else:
                cells.append("–")
        avg = f"{statistics.fmean(means):.1f}" if len(means) == len(datasets) else "–"
        ratio = sum(r["store_bytes"] for r in mine) / sum(r["store_full_fp16_bytes"] for r in mine)
        read = statistics.fmean(r["query_kv_bytes_stored"] for r in mine)
        full = statistics.fmean(r["query_kv_bytes_full"] for r in mine)
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {avg} | {ratio:.3f} ({1 / ratio:.2f}× smaller) | "
                     f"{_mib(read)} of {_mib(full)} fp16 |")
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md_path, json_path


def _label(row: dict, rows: list[dict]) -> str:
    """The method's name, plus its ratio and block size where the rows hold more than one of each."""
    label = row["method"] if row["method"] != DEFAULT else f"default = {row['resolved']}"
    def scaled(r):  # a method whose store changes with the ratio
        return not fixed_ratio(r.get("resolved", r["method"]))
    if scaled(row) and len({r.get("ratio_setting") for r in rows if scaled(r)}) > 1:
        label += f" ρ={row['ratio_setting']:g}"
    if len({r.get("block_size") for r in rows}) > 1:
        label += f" m={row.get('block_size')}"
    return label


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"

