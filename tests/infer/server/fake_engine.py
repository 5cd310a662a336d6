"""A test double of `milo_infer.runtime.engine.Engine`, a `ServingEngine` with no model, for the server's scheduler.

A query's answer is its own words upper-cased, one word per decode step (the first at admission),
until ``max_new_tokens`` (finish "length", default 8) or a stop string (finish "stop"). Its deltas
are spaced as a BPE model's: each word with a leading space, and a newline after the last one,
which the answer's text, stripped as the engine's is, does not have. Failures to
order: a query holding the word ``crash`` makes the batch raise at its next step, one holding
``choke`` makes its admission raise, and ``batch_limit`` makes ``batch()`` raise once that many
batches were made; one holding ``damaged`` finds block 0 unreadable and computes it. An admission
finds one block in the device tier and reads the rest from disk. The batch records what the scheduler
did to it: the size of every admission,
the rows at every step, the cancelled plans. A request asking for log probabilities gets each word's token
(`FakeTokenizer`) at -0.5 and its ``logprobs`` likeliest: the word, then lower-cased words at -1.5, -2.5, ...
"""
import threading
import time
from types import SimpleNamespace

import numpy as np

from milo_infer.runtime.interface import Answer, RowEvent
from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.planning import QueryPlan
from milo_infer.runtime.sampling import TokenLogprob
from milo_infer.runtime.prefix import BlockPlacement

MAX_QUERY_WORDS = 40
DEFAULT_MAX_NEW_TOKENS = 8


def expected_answer(text: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop=()) -> tuple[str, str]:
    """What the fake engine answers ``text``, and the finish reason."""
    words = []
    for word in text.upper().split():
        if word in stop:
            return " ".join(words), "stop"
        if len(words) == max_new_tokens:
            return " ".join(words), "length"
        words.append(word)
    return " ".join(words), "stop"


class FakeTokenizer:
    """Words as tokens: a word's id is its place in the vocabulary seen so far."""

    def __init__(self):
        self.words: list[str] = []

    def id(self, word: str) -> int:
        if word not in self.words:
            self.words.append(word)
        return self.words.index(word)

    def decode(self, ids) -> str:
        return "".join(self.words[i] for i in ids)


def fake_logprob(tokenizer: FakeTokenizer, word: str, top: int) -> TokenLogprob:
    token = tokenizer.id(" " + word)
    others = [(tokenizer.id(f" {word.lower()}{i}"), -1.5 - i) for i in range(top - 1)]
    return TokenLogprob(token, -0.5, tuple([(token, -0.5), *others][:top]))


def damaged(plan: QueryPlan) -> bool:
    return "damaged" in plan.request.text.split()


class FakeEngine:
    def __init__(self, stores=("demo",), *, max_positions=2048, plan_s=0.0, step_s=0.0, batch_limit=None,
                 crash_gate: threading.Event | None = None):
        self.stores = {name: SimpleNamespace(name=name, version="fake") for name in stores}
        self.max_positions, self.plan_s, self.step_s, self.batch_limit = max_positions, plan_s, step_s, batch_limit
        self.crash_gate = crash_gate  # when given, a crashing step first waits for it (a test's "now")
        self.batches: list[FakeBatch] = []
        self.tokenizer = FakeTokenizer()

    def plan(self, store: str, request) -> QueryPlan:
        if store not in self.stores:
            raise KeyError(store)
        time.sleep(self.plan_s)
        words = request.text.split()
        if len(words) > MAX_QUERY_WORDS:
            raise RequestError(f"the query alone ({len(words)} tokens) exceeds the model's positions")
        placement = BlockPlacement(store=store, blocks=[1, 0], dst_rows=np.array([2, 6]),
                                   segments=np.zeros((1, 0, 6), np.int64), prefix_tokens=10, kv_bytes_full=400,
                                   kv_bytes_stored=100)
        return QueryPlan(request=request, groups=[1], placement=placement, query_ids=list(range(len(words))),
                         max_new_tokens=request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS, retrieve_seconds=0.0)

    def batch(self) -> "FakeBatch":
        if self.batch_limit is not None and len(self.batches) >= self.batch_limit:
            raise RuntimeError("no device memory left for a batch")
        self.batches.append(FakeBatch(self))
        return self.batches[-1]


class FakeBatch:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.rows = {}  # id(plan) -> [plan, words to come, words given, thread]
        self.admissions: list[int] = []  # plans per admit call
        self.running_at_admission: list[int] = []  # rows already running at each admit call
        self.step_rows: list[int] = []
        self.cancelled: list[QueryPlan] = []
        self.fetch_stats = {}
        self.owner = None

    def _check_thread(self):
        self.owner = self.owner or threading.get_ident()
        assert self.owner == threading.get_ident(), "a Batch is used from one thread only"

    def admit(self, plans):
        self._check_thread()
        if any("choke" in p.request.text.split() for p in plans):
            raise RuntimeError("the prefix rebuild fell over")
        self.admissions.append(len(plans))
        self.running_at_admission.append(len(self.rows))
        blocks = [b for p in plans for b in p.blocks]
        self.fetch_stats = {"blocks": len(blocks), "unique_blocks": len(set(blocks)), "bytes": 100 * len(set(blocks)),
                            "bytes_without_union": 100 * len(blocks), "device_hits": 1,
                            "unreadable_blocks": int(any(damaged(p) for p in plans))}
        events = []
        for plan in plans:
            answer, reason = expected_answer(plan.request.text, plan.max_new_tokens, plan.request.stop)
            self.rows[id(plan)] = [plan, answer.split(), [], reason]
            events.append(self._advance(id(plan)))
        return events

    def step(self):
        self._check_thread()
        if self.engine.step_s:
            time.sleep(self.engine.step_s)
        self.step_rows.append(len(self.rows))
        if any("crash" in row[0].request.text.split() for row in self.rows.values()):
            if self.engine.crash_gate is not None:
                self.engine.crash_gate.wait(10)
            raise RuntimeError("the device fell over")
        return [self._advance(key) for key in list(self.rows)]

    def _advance(self, key) -> RowEvent:
        plan, to_come, given, reason = self.rows[key]
        delta, top = "", plan.request.sampling.logprobs
        logprobs = None
        if to_come:
            word = to_come.pop(0)
            delta = " " + word
            given.append(word)
            logprobs = None if top is None else [fake_logprob(self.engine.tokenizer, word, top)]
        if to_come:
            return RowEvent(plan=plan, delta=delta, finished=False, finish_reason=None, answer=None, logprobs=logprobs)
        delta += "\n"
        del self.rows[key]
        answer = Answer(text=" ".join(given), blocks=plan.blocks, groups=plan.groups, prefix_tokens=plan.prefix_tokens,
                        kv_bytes_full=plan.placement.kv_bytes_full, kv_bytes_stored=plan.placement.kv_bytes_stored,
                        seconds={"model": 0.001}, completion_tokens=len(given), finish_reason=reason,
                        recomputed_blocks=[0] if damaged(plan) else [],
                        logprobs=None if top is None else [fake_logprob(self.engine.tokenizer, w, top) for w in given])
        return RowEvent(plan=plan, delta=delta, finished=True, finish_reason=reason, answer=answer, logprobs=logprobs)

    def cancel(self, plan):
        self._check_thread()
        self.cancelled.append(plan)
        del self.rows[id(plan)]

    def idle(self):
        self._check_thread()

    def held_counts(self):
        blocks = [b for plan, *_ in self.rows.values() for b in plan.blocks]
        return {"kv_bytes_held": 100 * len(set(blocks)), "held_blocks": len(set(blocks)), "placed_blocks": len(blocks)}

    def __len__(self):
        return len(self.rows)
