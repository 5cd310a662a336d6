"""Accuracy and KV bytes of one store on held-out queries, resumable.

`evaluate` answers test queries from one store, scores them and measures the bytes each query
streamed. Every finished prediction is appended to a JSONL file, so a killed run resumes. Bytes are
always measured from the stores (`MiloStore.accounting`, the factor bytes each query read), never
computed from a formula. The method names (`methods`), the stores built from one encoding
(`shared_staging`) and the results table (`tables`) are beside this module.
"""
from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path
from typing import Callable

from milo_store import MiloStore
from milo_store.codecs.planning import allocation_record

from ..tasks.corpus import Demonstration, TaskSpec
from ..models import LoadedModel
from ..tasks.scoring import is_correct
from ..runtime.planning import MAX_NEW_TOKENS, EngineSettings
from ..runtime.session import MiloSession


EVAL_BATCH = 8  # queries per forward in `milo eval`: ~2x batch 1 on a CPU (docs/benchmarks.md)


def evaluate(loaded: LoadedModel, store_path, test: list[Demonstration], task: TaskSpec, k: int = 6,
             n: int | None = None, *, predictions=None, max_new_tokens: int = MAX_NEW_TOKENS,
             on_answer: Callable[[dict], None] | None = None, batch: int = EVAL_BATCH, prefill: bool = False,
             recompute: int = 0) -> dict:
    """Answer the first ``n`` test items from the store, ``batch`` per forward (each row its own
    retrieval; the predictions are those of one at a time); accuracy, bytes, time per stage, time to
    first token and tokens prefilled. ``prefill``: the model prefills the retrieved demonstrations'
    tokens instead of reading their K/V (`MiloSession`'s ``prefill``); ``recompute``: the model computes each
    retrieved block's first that many tokens again after the rebuild (`MiloSession`'s ``recompute``).

    ``predictions`` (a JSONL path) keeps one line per finished item; items already there are not
    asked again. Its lines carry a key of the store's allocation and ``k``: lines from another
    store or another k raise rather than mix into this result.
    """
    items = test if n is None else test[:n]
    if not items:
        raise ValueError("no test items to evaluate")
    with MiloStore.open(store_path, tier="host") as store:
        key = _run_key(store, k, max_new_tokens if task.answer_kind != "label" else MAX_NEW_TOKENS, prefill, recompute)
        done = _read_predictions(predictions, key) if predictions is not None else {}
        pending = [item for item in items if item.id not in done]
        session = (MiloSession(loaded, store, settings=EngineSettings(k=k, max_new_tokens=max_new_tokens, recompute=recompute), prefill=prefill)
                   if pending else None)
        for start in range(0, len(pending), batch):
            chunk = pending[start:start + batch]
            for item, answer in zip(chunk, session.answer_batch([item.input for item in chunk])):
                reference = task.answer_of(item.output) or item.output
                record = {"key": key, "id": item.id, "input": item.input, "reference": reference,
                          "prediction": answer.text, "correct": is_correct(answer.text, reference, task.answer_kind),
                          "blocks": answer.blocks, "groups": answer.groups, "kv_bytes_full": answer.kv_bytes_full,
                          "kv_bytes_stored": answer.kv_bytes_stored, "seconds": answer.seconds,
                          "first_token_seconds": answer.first_token_seconds, "prefill_tokens": answer.prefill_tokens}
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
            "store_ratio": acc["ratio"], "seconds": stages, "first_token_seconds": _mean(records, "first_token_seconds"),
            "prefill_tokens": _mean(records, "prefill_tokens"), "answers": {r["id"]: r["prediction"] for r in records}}


def _mean(records: list[dict], field: str) -> float | None:
    """The mean of a field over the records that log it (predictions written before it existed do not)."""
    values = [r[field] for r in records if field in r]
    return statistics.fmean(values) if values else None


def agreement(answers: dict, reference: dict) -> float | None:
    """Share of the items both answered on which ``answers`` equal ``reference``'s (None if none shared)."""
    shared = answers.keys() & reference.keys()
    return sum(answers[i] == reference[i] for i in shared) / len(shared) if shared else None


def _run_key(store: MiloStore, k: int, max_new_tokens: int = MAX_NEW_TOKENS, prefill: bool = False,
             recompute: int = 0) -> str:
    """What a logged answer depends on besides the question (a non-default free-form answer length and
    a recompute are added only when set, so logs written before they existed keep their key). A prefilled answer
    depends on neither the store's allocation nor the context its blocks were encoded in."""
    build = store.meta.get("build")
    what = {"allocation": allocation_record(store.meta.get("allocation")), "build": build,
            "model": store.meta.get("model", {}).get("config_hash"), "k": k}
    if prefill:
        what = {**what, "allocation": None, "prefill": True,
                "build": {f: v for f, v in (build or {}).items() if f != "context_blocks"}}
    if max_new_tokens != MAX_NEW_TOKENS:
        what["max_new_tokens"] = max_new_tokens
    if recompute:
        what["recompute"] = recompute
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
