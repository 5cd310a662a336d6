"""What one query needs from a mounted store, decided on the host without touching the model.

A `QueryPlan` is plain data: the retrieved groups and their store blocks in context order, where each
block's rows go in the assembled context [anchor][blocks][query], every layer's segment table (source
offsets relative to each block's own layer slice: the executor shifts them to wherever the batch's
fetch put the block), the query's token ids, the answer budget and the bytes involved. Planning has
no side effects, so plans can be made on any thread (a server's handlers), batched in any
combination, and tested without a model. Execution is `milo_infer.runtime.engine`.

Retrieval ranks *groups*, the blocks of m demonstrations the build encoded together; a store whose
blocks are finer (``block_group``: one store block per demonstration, the example-svd baseline)
puts each selected group's store blocks in order, so every store of one build gives a query the
same demonstrations in the same order.

A prefill request (``Request(prefill=True)``, the `prefill` method of `milo eval`) retrieves the same
groups and plans no prefix at all: its "query" is the token ids the store's anchor and retrieved
blocks were encoded from, then the query's, so the engine's one prefill forward computes every K/V
itself (no store read, no rebuild). The ids are the stored ones rather than a tokenization of the
joined text, so the only difference from the `full` store is attention across blocks.

A recompute request (``Request(recompute=n)``, EPIC-style) rebuilds the prefix as usual and has the
model compute the first n tokens of every retrieved block again, in the assembled context: the plan's
``recompute`` lists their context positions, and its forward feeds their stored ids before the
query's. The engine masks their rebuilt columns out, so what follows reads only their fresh K/V
(docs/design.md, "Query-time recompute").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from milo_store import IncompatibleStoreError, MiloStore

from ..tasks.corpus import TaskSpec
from .decoding import LabelTrie
from .prefix import StorePrefix, prefix_token_ids
from .retrieval import order_blocks, store_retriever

IDENTITY_FIELDS = ("config_hash", "num_layers", "num_kv_heads", "head_dim", "rope")
MAX_NEW_TOKENS = 64  # longest free-form answer by default (labels are bounded by their own trie)
STOP_STRINGS = ("\n\n", "\nInput:", "\nQuery:")  # where a free-form answer ends: the next demonstration


class RequestError(ValueError):
    """A request no batch can serve as asked (its context exceeds the model's positions, an empty
    query, a budget below one token); the message names the problem."""


@dataclass(frozen=True)
class Request:
    text: str  # the query
    k: int | None = None  # groups to retrieve (None: the engine's default)
    token_budget: int | None = None  # or the tokens the retrieved groups may take
    max_new_tokens: int | None = None  # None: a label's length, or MAX_NEW_TOKENS for free-form answers
    stop: tuple[str, ...] = ()  # extra stop strings (free-form answers)
    prefill: bool = False  # the model prefills the retrieved demonstrations' tokens instead of rebuilding their K/V
    recompute: int | None = None  # first tokens of each block the model computes again (None: the engine's default)


@dataclass(frozen=True, eq=False)
class QueryPlan:
    store: str  # the mounted store's name
    request: Request
    groups: list[int]  # retrieved groups, in context order
    blocks: list[int]  # their store blocks to rebuild, in context order (none for a prefill request)
    query_ids: list[int]  # what the prefill forward feeds: recomputed tokens' ids, then the query's (a prefill
    # request: anchor, blocks and query)
    prefix_tokens: int  # anchor + blocks rebuilt from the store (0 for a prefill request)
    dst_rows: np.ndarray  # int64 [n]: each block's first row in the assembled context
    segments: np.ndarray  # int64 [L, n*2*H, 6]: SEGMENT_COLUMNS, src_offset relative to the block's layer slice
    max_new_tokens: int  # the answer's budget
    kv_bytes_full: int  # fp16 K/V of the blocks
    kv_bytes_stored: int  # the factor bytes the blocks take in the store
    retrieve_seconds: float
    recompute: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 [m]: context positions
    # of the rebuilt tokens computed again, ascending; their ids open query_ids

    @property
    def prompt_tokens(self) -> int:
        """Positions the context takes: the prefix, then the query (recomputed tokens sit inside the prefix)."""
        return self.prefix_tokens + len(self.query_ids) - len(self.recompute)

    @property
    def positions(self) -> np.ndarray:
        """int64 [len(query_ids)]: the RoPE position of every token the forward feeds."""
        query = self.prefix_tokens + np.arange(len(self.query_ids) - len(self.recompute), dtype=np.int64)
        return np.concatenate([self.recompute, query])


def check_compatible(store: MiloStore, identity: dict) -> None:
    """Refuse a store whose K/V another model (shape, RoPE, config) produced."""
    stored = store.meta.get("model") or {}
    wrong = [f"{k}: store {stored.get(k)!r} vs model {identity.get(k)!r}" for k in IDENTITY_FIELDS
             if stored.get(k) != identity.get(k)]
    if wrong:
        raise IncompatibleStoreError(f"{store.path} was built for another model ({stored.get('name')}): " + "; ".join(wrong))


class StoreQueries:
    """What a query needs from a store besides its K/V: the retriever, the task's query rendering and its
    label trie (a client that sends requests to another engine needs only this)."""

    def __init__(self, store: MiloStore, tokenizer, aggregate: str = "max"):
        self.tokenizer = tokenizer
        self.task = TaskSpec(**{**store.meta["task"], "labels": tuple(store.meta["task"].get("labels", ()))})
        self.retriever = store_retriever(store, aggregate=aggregate)
        self.trie = LabelTrie(tokenizer, list(self.task.labels)) if self.task.answer_kind == "label" else None
        self.num_groups = store.num_groups

    def select(self, text: str, k: int, token_budget: int | None, order: str) -> list[int]:
        """The retrieved groups in context order (k and token_budget count groups and their tokens)."""
        ids = self.retriever.select(text, k=min(k, self.num_groups), token_budget=token_budget)
        return order_blocks(ids, self.retriever.scores(text), order=order)

    def query_ids(self, text: str) -> list[int]:
        return self.tokenizer(self.task.render_query(text), add_special_tokens=False).input_ids

    def answer_budget(self, request: Request, default: int) -> int:
        """New tokens the answer may take: a label's trie length (or less, if asked), else the request's."""
        asked = request.max_new_tokens
        if asked is not None and asked < 1:
            raise RequestError(f"max_new_tokens must be at least 1, got {asked}")
        if self.trie is not None:
            return min(self.trie.max_tokens, asked) if asked is not None else self.trie.max_tokens
        return asked if asked is not None else default


class MountedStore(StorePrefix, StoreQueries):
    """A store ready to answer from: its anchor and block placement (`StorePrefix`) and its queries'
    retrieval, rendering and labels (`StoreQueries`)."""

    def __init__(self, name: str, store: MiloStore, tokenizer, cos: torch.Tensor, sin: torch.Tensor, device, dtype,
                 aggregate: str = "max"):
        StorePrefix.__init__(self, name, store, cos, sin, device, dtype)
        StoreQueries.__init__(self, store, tokenizer, aggregate)

    def plan(self, request: Request, *, k: int, token_budget: int | None, order: str, max_new_tokens: int,
             max_positions: int, recompute: int = 0, block_ids: list[int] | None = None) -> QueryPlan:
        """Plan one query; ``block_ids`` overrides retrieval (exactness checks place chosen blocks)."""
        t = time.perf_counter()
        k = request.k if request.k is not None else k
        token_budget = request.token_budget if request.token_budget is not None else token_budget
        recompute = request.recompute if request.recompute is not None else recompute
        if k < 1:
            raise RequestError(f"k must be at least 1, got {k}")
        if recompute < 0:
            raise RequestError(f"recompute must be 0 or more tokens per block, got {recompute}")
        groups = self.select(request.text, k, token_budget, order) if block_ids is None else []
        blocks = self.store.blocks_of(groups) if block_ids is None else list(block_ids)
        query_ids = self.query_ids(request.text)
        budget = self.answer_budget(request, max_new_tokens)
        seconds = time.perf_counter() - t
        own = self.anchor_len + len(query_ids) + budget + 1
        if own > max_positions:
            raise RequestError(f"the query itself is too long: the anchor ({self.anchor_len} tokens), the query "
                               f"({len(query_ids)}) and the answer ({budget}) exceed the model's {max_positions} "
                               f"positions before any demonstration is added")
        placed = self.place(blocks, with_segments=not request.prefill)
        if placed.prefix_tokens + len(query_ids) + budget + 1 > max_positions:
            raise RequestError(f"the assembled context ({placed.prefix_tokens} tokens of anchor and blocks + "
                               f"{len(query_ids)} for the query + {budget + 1} for the answer) exceeds the model's "
                               f"{max_positions} positions; lower k or set a token budget")
        if request.prefill:
            return self.prefill_plan(request, groups, blocks, query_ids, budget, seconds)
        positions, ids = self.recompute_tokens(blocks, placed.dst_rows, recompute)
        return QueryPlan(store=self.name, request=request, groups=groups, blocks=blocks, query_ids=ids + query_ids,
                         prefix_tokens=placed.prefix_tokens, dst_rows=placed.dst_rows, segments=placed.segments,
                         max_new_tokens=budget, kv_bytes_full=placed.kv_bytes_full,
                         kv_bytes_stored=placed.kv_bytes_stored, retrieve_seconds=seconds, recompute=positions)

    def recompute_tokens(self, blocks: list[int], dst: np.ndarray, n: int) -> tuple[np.ndarray, list[int]]:
        """The context positions and stored ids of each block's first ``n`` tokens, in context order."""
        if n == 0 or not blocks:
            return np.zeros(0, np.int64), []
        texts = [self.store.token_ids(b) for b in blocks]
        if any(ids is None for ids in texts):
            raise RequestError(f"{self.store.path} keeps no token ids for its blocks: recompute needs a store "
                               f"`milo build` wrote")
        heads = [ids[:n] for ids in texts]
        positions = np.concatenate([start + np.arange(len(h), dtype=np.int64) for start, h in zip(dst, heads)])
        return positions, [int(t) for h in heads for t in h]

    def prefill_plan(self, request: Request, groups: list[int], blocks: list[int], query_ids: list[int],
                     budget: int, seconds: float) -> QueryPlan:
        """The plan that feeds [anchor ids][each block's ids][query ids] to the model, with nothing to rebuild."""
        prefix = prefix_token_ids(self.store, blocks)
        if prefix is None:
            raise RequestError(f"{self.store.path} keeps no token ids for its anchor or blocks: prefill needs a "
                               f"store `milo build` wrote")
        ids = prefix + query_ids
        return QueryPlan(store=self.name, request=request, groups=groups, blocks=[], query_ids=ids, prefix_tokens=0,
                         dst_rows=np.zeros(0, np.int64), segments=np.zeros((self.layout.num_layers, 0, 6), np.int64),
                         max_new_tokens=budget, kv_bytes_full=0, kv_bytes_stored=0, retrieve_seconds=seconds)
