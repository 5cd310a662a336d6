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
blocks were encoded from, then the query's, so the engine's prefill of it computes every K/V
itself (no store read, no rebuild). The ids are the stored ones rather than a tokenization of the
joined text, so the only difference from the `full` store is attention across blocks.

A recompute request (``Request(recompute=n)``, EPIC-style; refused on a hybrid model, whose blocks' linear-layer
pairs cover all of their tokens) rebuilds the prefix as usual and has the
model compute the first n tokens of every retrieved block again, in the assembled context: the plan's
``recompute`` lists their context positions, and its forward feeds their stored ids before the
query's. The engine masks their rebuilt columns out, so what follows reads only their fresh K/V
(docs/design.md, "Query-time recompute").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from milo_store import MiloStore

from ..models import RopeTables, media_problem
from ..tasks.corpus import SYSTEM_SEPARATOR, Demonstration, TaskSpec
from .decoding import UNTIL_EOS, Ending, LabelTrie
from .errors import BlockLoadError, RequestError
from .grammar import Grammar, compile_grammar
from .sampling import GREEDY, SamplingParams
from .prefix import BlockPlacement, StorePrefix, prefix_token_ids
from .retrieval import order_blocks, store_retriever

HYBRID_RECOMPUTE = ("recompute is refused on a hybrid model: its linear layers' state is carried across each block by "
                    "the block's stored pair over all of its tokens, so computing a block's first tokens again would "
                    "feed them to the recurrence twice; ask for recompute 0")
MAX_NEW_TOKENS = 64  # longest free-form answer by default (labels are bounded by their own trie)
STOP_STRINGS = ("\n\n", "\nInput:", "\nQuery:")  # where a free-form answer ends: the next demonstration


ORDERS = ("score", "corpus")
AGGREGATES = ("max", "sum-top-n")


@dataclass(frozen=True)
class EngineSettings:
    """What an engine answers with unless a request says otherwise: one definition shared by milo's
    engine, its one-store session and the vLLM client side, so every front end retrieves alike."""

    k: int = 6  # groups retrieved per query
    token_budget: int | None = None  # or the tokens the retrieved groups may take
    order: str = "score"  # the retrieved groups' order in the context (ORDERS)
    max_new_tokens: int = MAX_NEW_TOKENS  # a free-form answer's budget
    aggregate: str = "max"  # a group's score from its demonstrations' (AGGREGATES)
    recompute: int = 0  # first tokens of each retrieved block the model computes again
    prefill_chunk: int = 512  # prompt tokens one step feeds at most (running rows wait no longer than that)

    def __post_init__(self):
        problems = [f"{name} must be at least {least}, got {value}" for name, value, least in
                    (("k", self.k, 1), ("max_new_tokens", self.max_new_tokens, 1), ("recompute", self.recompute, 0),
                                          ("prefill_chunk", self.prefill_chunk, 1))
                    if value < least]
        if self.token_budget is not None and self.token_budget < 1:
            problems.append(f"token_budget must be at least 1, got {self.token_budget}")
        if self.order not in ORDERS:
            problems.append(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.aggregate not in AGGREGATES:
            problems.append(f"aggregate must be one of {', '.join(AGGREGATES)}, got {self.aggregate!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Request:
    text: str  # the query
    k: int | None = None  # groups to retrieve (None: the engine's default)
    token_budget: int | None = None  # or the tokens the retrieved groups may take
    max_new_tokens: int | None = None  # None: a label's length, or MAX_NEW_TOKENS for free-form answers
    stop: tuple[str, ...] = ()  # extra stop strings (free-form answers)
    ending: Ending = UNTIL_EOS  # where else a free-form answer ends (stop tokens, min_tokens, ignore_eos, ...)
    prefill: bool = False  # the model prefills the retrieved demonstrations' tokens instead of rebuilding their K/V
    recompute: int | None = None  # first tokens of each block the model computes again (None: the engine's default)
    sampling: SamplingParams = GREEDY  # how its tokens are chosen, and the log probabilities it reports
    grammar: tuple[str, str] | None = None  # (kind, source) the answer is held to: a JSON schema's text, a regular
    # expression or an EBNF grammar (`grammar.GRAMMAR_KINDS`)
    choices: tuple[str, ...] = ()  # or strings the answer is one of (as a label store's labels)
    system: str | None = None  # a chat's system message: the store's own is answered as built; another is read
    # after the demonstrations, before the query (`StoreQueries.context`)
    turns: tuple[tuple[str, str], ...] = ()  # a chat's earlier (user, assistant) turns: read as demonstrations
    # after the retrieved ones, before the query


@dataclass(frozen=True, eq=False)
class QueryPlan:
    request: Request
    groups: list[int]  # retrieved groups, in context order
    placement: BlockPlacement  # the store, its blocks to rebuild in context order (none for a prefill request),
    # where each goes and every layer's segment table
    query_ids: list[int]  # what its prefill feeds: recomputed tokens' ids, then the query's (a prefill
    # request: anchor, blocks and query)
    max_new_tokens: int  # the answer's budget
    retrieve_seconds: float
    recompute: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 [m]: context positions
    # of the rebuilt tokens computed again, ascending; their ids open query_ids
    mount: "MountedStore | None" = None  # the store version it was planned against, which answers it (a server
    # that mounts a newer version meanwhile still answers this plan from this one); None: a test's fake plan
    form: "LabelTrie | Grammar | None" = None  # what its answer must be: a label (of the store's or the
    # request's choices), text of a grammar, or free text (None); each gives its row's decoder (``form.decoder``)
    prompt_ids: tuple[int, ...] = ()  # every token id of its prompt, where its repetition penalty counts them

    @property
    def store(self) -> str:
        return self.placement.store

    @property
    def blocks(self) -> list[int]:
        return self.placement.blocks

    @property
    def prefix_tokens(self) -> int:
        return self.placement.prefix_tokens

    @property
    def prompt_tokens(self) -> int:
        """Positions the context takes: the prefix, then the query (recomputed tokens sit inside the prefix)."""
        return self.prefix_tokens + len(self.query_ids) - len(self.recompute)

    @property
    def positions(self) -> np.ndarray:
        """int64 [len(query_ids)]: the RoPE position of every token the forward feeds."""
        query = self.prefix_tokens + np.arange(len(self.query_ids) - len(self.recompute), dtype=np.int64)
        return np.concatenate([self.recompute, query])


class StoreQueries:
    """What a query needs from a store besides its K/V: the retriever, the task's query rendering and its
    label trie (a client that sends requests to another engine needs only this)."""

    def __init__(self, store: MiloStore, tokenizer, aggregate: str = "max"):
        self.store, self.tokenizer = store, tokenizer
        self.task = TaskSpec(**{**store.meta["task"], "labels": tuple(store.meta["task"].get("labels", ()))})
        self.retriever = store_retriever(store, aggregate=aggregate)
        self.trie = LabelTrie(tokenizer, list(self.task.labels)) if self.task.answer_kind == "label" else None
        self.num_groups = store.num_groups

    def select(self, text: str, k: int, token_budget: int | None, order: str) -> list[int]:
        """The retrieved groups in context order (k and token_budget count groups and their tokens)."""
        ids = self.retriever.select(text, k=min(k, self.num_groups), token_budget=token_budget)
        return order_blocks(ids, self.retriever.scores(text), order=order)

    def choose(self, request: Request, settings: EngineSettings,
               block_ids: list[int] | None = None) -> tuple[list[int], list[int]]:
        """The request's groups and their store blocks, in context order: retrieved with the request's k
        and token budget where it gives them, else the settings'; ``block_ids`` overrides retrieval
        (exactness checks place chosen blocks) and then no group is named."""
        if block_ids is not None:
            return [], list(block_ids)
        k = request.k if request.k is not None else settings.k
        if k < 1:
            raise RequestError(f"k must be at least 1, got {k}")
        token_budget = request.token_budget if request.token_budget is not None else settings.token_budget
        groups = self.select(request.text, k, token_budget, settings.order)
        return groups, self.store.blocks_of(groups)

    def query_ids(self, request: Request) -> list[int]:
        """The query as the store's template writes it, after the request's own context (`context`)."""
        text = self.context(request) + self.task.render_query(request.text)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def context(self, request: Request) -> str:
        """What a request reads between the retrieved demonstrations and its query: a system message other than the
        one the store was built with (that one is in the anchor already), then its earlier turns, each written as a
        demonstration of the store's template (a turn is a question and its answer, as a demonstration is)."""
        system = request.system
        own = system if system is not None and system.strip() != self.task.system.strip() else None
        turns = "".join(self.task.render(Demonstration(user, assistant, "")) for user, assistant in request.turns)
        return (own + SYSTEM_SEPARATOR if own else "") + turns

    def form(self, request: Request) -> LabelTrie | Grammar | None:
        """What the answer must be: text of the request's grammar, one of its choices, else the store's labels (or
        free text for a store without). A form ends where it is complete: a stop string or an ending that asks for
        more is refused, naming its field, and so is a stop token the vocabulary does not hold."""
        if request.grammar is not None:
            form = compile_grammar(self.tokenizer, *request.grammar)
        elif request.choices:
            try:
                form = LabelTrie(self.tokenizer, list(request.choices))
            except ValueError as e:
                raise RequestError(f"choices: {e}") from None
        else:
            form = self.trie
        asks = ("stop",) * bool(request.stop) + request.ending.asks
        if form is not None and asks:
            what = "the store's labels" if form is self.trie else "its structured output"
            raise RequestError(f"{asks[0]}: an answer held to {what} ends where that is complete")
        if (beyond := [t for t in request.ending.stop_token_ids if t >= len(self.tokenizer)]):
            raise RequestError(f"stop_token_ids: {beyond[0]} is not a token of the model's {len(self.tokenizer)}")
        return form

    def answer_budget(self, request: Request, default: int, form=None) -> int:
        """New tokens the answer may take: a label's trie length (or less, if asked), else the request's; ``form``:
        the answer's (`form`; None: the store's)."""
        form = self.trie if form is None else form
        asked = request.max_new_tokens
        if asked is not None and asked < 1:
            raise RequestError(f"max_new_tokens must be at least 1, got {asked}")
        if isinstance(form, LabelTrie):
            return min(form.max_tokens, asked) if asked is not None else form.max_tokens
        return asked if asked is not None else default


def check_context(anchor_tokens: int, prefix_tokens: int, query_tokens: int, budget: int, max_positions: int) -> None:
    """Refuse a context the model has no positions for, naming the query when it alone is too long."""
    if anchor_tokens + query_tokens + budget + 1 > max_positions:
        raise RequestError(f"the query itself is too long: the anchor ({anchor_tokens} tokens), the query "
                           f"({query_tokens}) and the answer ({budget}) exceed the model's {max_positions} "
                           f"positions before any demonstration is added")
    if prefix_tokens + query_tokens + budget + 1 > max_positions:
        raise RequestError(f"the assembled context ({prefix_tokens} tokens of anchor and blocks + "
                           f"{query_tokens} for the query + {budget + 1} for the answer) exceeds the model's "
                           f"{max_positions} positions; lower k or set a token budget")


class MountedStore:
    """A store ready to answer from: its anchor and block placement on the device (``prefix``) and its
    queries' retrieval, rendering and labels (``queries``). ``windows`` (the model's, per layer; None: read every
    layer of every block) makes each plan's placement name the blocks each window layer reaches from the row's
    first fed token (`BlockPlacement.windowed`): only those are read and rebuilt there. A query holding one of
    ``media`` (a multimodal checkpoint's image or video tokens: `models.media_tokens`) is refused."""

    def __init__(self, name: str, store: MiloStore, tokenizer, rope: RopeTables, device, dtype,
                 aggregate: str = "max", windows: list[int | None] | None = None, media: dict[str, int] | None = None):
        self.name, self.store, self.windows, self.media = name, store, windows, media or {}
        self.prefix = StorePrefix(name, store, rope, device, dtype)
        self.queries = StoreQueries(store, tokenizer, aggregate)
        self.linear = any(spec.state_values for spec in store.layout.layers)  # a hybrid's: recompute refused

    @property
    def version(self) -> str:
        return self.store.version

    def plan(self, request: Request, settings: EngineSettings, max_positions: int,
             block_ids: list[int] | None = None) -> QueryPlan:
        """Plan one query; ``block_ids`` overrides retrieval (exactness checks place chosen blocks)."""
        t = time.perf_counter()
        recompute = request.recompute if request.recompute is not None else settings.recompute
        if recompute < 0:
            raise RequestError(f"recompute must be 0 or more tokens per block, got {recompute}")
        groups, blocks = self.queries.choose(request, settings, block_ids)
        query_ids = self.queries.query_ids(request)
        if problem := media_problem(self.media, query_ids, "the query"):
            raise RequestError(problem)
        form = self.queries.form(request)
        budget = self.queries.answer_budget(request, settings.max_new_tokens, form)
        if request.ending.min_tokens > budget:
            raise RequestError(f"min_tokens: {request.ending.min_tokens} is more than the answer's budget of {budget} "
                               f"tokens (max_tokens)")
        seconds = time.perf_counter() - t
        placed = self.prefix.place(blocks, with_segments=not request.prefill)
        check_context(self.prefix.anchor_len, placed.prefix_tokens, len(query_ids), budget, max_positions)
        if request.prefill:
            return self.prefill_plan(request, groups, blocks, query_ids, budget, seconds, form)
        if recompute and self.linear:
            raise RequestError(HYBRID_RECOMPUTE)
        positions, ids = self.recompute_tokens(blocks, placed.dst_rows, recompute)
        placed = placed.windowed(int(positions[0]) if len(positions) else placed.prefix_tokens, self.windows)
        return QueryPlan(request=request, groups=groups, placement=placed, query_ids=ids + query_ids,
                         max_new_tokens=budget, retrieve_seconds=seconds, recompute=positions, mount=self, form=form,
                         prompt_ids=self.penalised_prompt(request, blocks, query_ids))

    def penalised_prompt(self, request: Request, blocks: list[int], query_ids: list[int]) -> tuple[int, ...]:
        """The prompt's token ids (anchor, blocks, query) where the request's repetition penalty counts them, else
        none; a store that keeps no token ids cannot say what its blocks hold, so the penalty is refused there."""
        if request.sampling.repetition_penalty == 1:
            return ()
        prefix = prefix_token_ids(self.store, blocks)
        if prefix is None:
            raise RequestError(f"repetition_penalty: {self.store.path} keeps no token ids for its blocks, so the "
                               f"prompt's tokens it penalises are unknown")
        return tuple(prefix + query_ids)

    def without_blocks(self, plan: QueryPlan, unread: set[int]) -> QueryPlan:
        """``plan`` with the blocks of ``unread`` computed by the model from the token ids the store keeps for
        them, in the same forward as the query, instead of read and rebuilt: their columns stay in the
        context, masked, and their tokens join the recomputed ones at their own positions (the same
        mechanism as ``Request.recompute``, so the rest of the row is as planned). Raises `BlockLoadError`
        when the store keeps no token ids for them."""
        recomputed = dict(zip(plan.recompute.tolist(), plan.query_ids[:len(plan.recompute)]))
        for b, start in zip(plan.blocks, plan.placement.dst_rows.tolist()):
            if b not in unread:
                continue
            ids = self.store.token_ids(b)
            if ids is None:
                raise BlockLoadError(f"store {self.name!r}: block {b} cannot be read and the store keeps no token ids "
                                     f"to compute it from")
            recomputed.update({start + j: int(t) for j, t in enumerate(ids)})
        positions = sorted(recomputed)
        placement = self.prefix.place(plan.blocks, unread=frozenset(unread))
        placement = placement.windowed(positions[0] if positions else placement.prefix_tokens, self.windows)
        return replace(plan, placement=placement, recompute=np.array(positions, dtype=np.int64),
                       query_ids=[recomputed[q] for q in positions] + plan.query_ids[len(plan.recompute):])

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
                     budget: int, seconds: float, form=None) -> QueryPlan:
        """The plan that feeds [anchor ids][each block's ids][query ids] to the model, with nothing to rebuild."""
        prefix = prefix_token_ids(self.store, blocks)
        if prefix is None:
            raise RequestError(f"{self.store.path} keeps no token ids for its anchor or blocks: prefill needs a "
                               f"store `milo build` wrote")
        return QueryPlan(request=request, groups=groups, placement=self.prefix.nothing_placed(),
                         query_ids=prefix + query_ids, max_new_tokens=budget, retrieve_seconds=seconds, mount=self,
                         form=form, prompt_ids=tuple(prefix + query_ids) if request.sampling.repetition_penalty != 1
                         else ())


def answers_of(plan: QueryPlan, n: int) -> list[QueryPlan]:
    """``n`` answers to ``plan``'s request as ``n`` rows of one plan (its retrieval and blocks, read and held once by
    a batch that seats them together): the first is ``plan`` itself, answer i samples with its seed moved by i."""
    return [plan] + [replace(plan, request=replace(plan.request, sampling=plan.request.sampling.sample(i)))
                     for i in range(1, n)]
