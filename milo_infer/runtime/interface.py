"""What a front end drives: the engine interface the server, the evaluation and the CLI are written against.

Two engines implement it: milo's own (`engine.Engine`, rebuilding prefixes from stores into its batched
cache) and `milo_infer.vllm.engine.VllmEngine` (milo plans, a vLLM server batches and loads the prefix
through milo's connector); the server's tests drive a fake with no model. A front end plans requests on
any thread (`plan` is host-only and read-only) and hands the plans to one thread that owns a running
batch: ``admit`` them, ``step`` until every row finished, ``cancel`` a row whose client left.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

from .planning import QueryPlan, Request
from .sampling import TokenLogprob


@dataclass
class Answer:
    text: str
    blocks: list[int]  # store blocks, in context order
    groups: list[int]  # the retrieved groups they come from
    prefix_tokens: int
    kv_bytes_full: int
    kv_bytes_stored: int  # the factor bytes of its blocks in the store
    seconds: dict = field(default_factory=dict)
    kv_bytes_moved: int = 0  # its share of the bytes its admission really moved (shared blocks once, tier hits none)
    completion_tokens: int = 0
    finish_reason: str = "stop"  # "stop" (label closed, stop string, eos) or "length"
    first_token_seconds: float = 0.0  # retrieval + its admission's wall time (every row of it waits for the whole)
    prefill_tokens: int = 0  # prompt tokens the model computed for it (its prefill chunks)
    recomputed_blocks: list[int] = field(default_factory=list)  # blocks that could not be read, computed by the model
    logprobs: list[TokenLogprob] | None = None  # each chosen token's, where its request asked (`SamplingParams`)


@dataclass
class RowEvent:
    """One row's progress in one forward."""
    plan: QueryPlan
    delta: str  # text this forward added to the answer ('' allowed)
    finished: bool
    finish_reason: str | None = None
    answer: Answer | None = None
    error: Exception | None = None  # the row ended with this instead of an answer (a `RowError`)
    logprobs: list[TokenLogprob] | None = None  # those of the tokens this forward chose, where its request asked


@runtime_checkable
class RunningBatch(Protocol):
    """Rows being answered, used from one thread; a finished or cancelled row leaves, so ``len`` counts the
    rows still decoding. ``fetch_stats`` says what the last admission read (empty where nothing is read)."""

    fetch_stats: dict

    def admit(self, plans: list[QueryPlan]) -> list[RowEvent]: ...

    def step(self) -> list[RowEvent]: ...

    def cancel(self, plan: QueryPlan) -> None: ...

    def idle(self) -> None:
        """Nothing was asked for a while: let go of what is kept for the next rows (the engine's K/V pools)."""

    def held_counts(self) -> dict:
        """Now: the K/V bytes its pages hold, the distinct blocks its rows hold once and the blocks they place
        (`engine.Batch.held_counts`; empty where another process holds the K/V)."""

    def __len__(self) -> int: ...


@runtime_checkable
class ServingEngine(Protocol):
    """The mounted stores by name (each with the ``version`` that answers new requests), the longest context
    any of them allows, planning (raises `RequestError` for a request no batch can serve, KeyError for an
    unknown store) and a new running batch."""

    stores: Mapping[str, object]
    max_positions: int

    def plan(self, store: str, request: Request) -> QueryPlan: ...

    def batch(self) -> RunningBatch: ...
