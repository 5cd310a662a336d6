"""Choosing which stored demonstration blocks to put in front of a query.

The store keeps one compressed KV cache per block of ~32 demonstrations, so
retrieval works at block granularity: every demonstration is scored against the
query, each block gets an aggregate of its demonstrations' scores, and the best
blocks are selected by count (``k``), by the context they would occupy
(``token_budget``), or both.

Scoring and selection are kept apart on purpose: a retriever only has to turn
a query into one score per block (:class:`Retriever`), and :func:`select_blocks`
and :func:`order_blocks` do the rest the same way for every retriever, so a
dense retriever can later replace BM25 without touching the inference loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from milo_store import MiloStore, StoreCorruptedError, text_index
from milo_store.text_index import TextIndex, build_text_index, tokenize

Aggregate = Literal["max", "sum-top-n"]
Order = Literal["score", "corpus"]

__all__ = ["BM25BlockRetriever", "Retriever", "order_blocks", "select_blocks", "store_retriever", "tokenize"]


@runtime_checkable
class Retriever(Protocol):
    """What the inference loop needs from a block retriever.

    ``block_tokens[b]`` is the number of tokens block ``b`` occupies in context;
    ``scores(query)[b]`` is how relevant block ``b`` is (higher is better).
    """

    @property
    def block_tokens(self) -> np.ndarray: ...

    def scores(self, query: str) -> np.ndarray: ...

    def select(
        self, query: str, k: int | None = None, token_budget: int | None = None
    ) -> list[int]: ...


def select_blocks(
    scores: np.ndarray,
    block_tokens: np.ndarray,
    k: int | None = None,
    token_budget: int | None = None,
) -> list[int]:
    """Pick block ids, most relevant first, within ``k`` blocks and/or ``token_budget`` tokens.

    Blocks are ranked by score, ties broken by the smaller block id so the
    result never depends on sort stability. With a budget, blocks are taken
    greedily in rank order and a block that would overflow is skipped (a
    smaller, lower-ranked block may still fit), which keeps the budget a hard
    limit on context length.
    """
    scores = np.asarray(scores, dtype=np.float64)
    block_tokens = np.asarray(block_tokens)
    if scores.shape != block_tokens.shape or scores.ndim != 1:
        raise ValueError(
            f"need one score per block: got {scores.shape} scores for {block_tokens.shape} blocks"
        )
    if k is None and token_budget is None:
        raise ValueError("give k, token_budget, or both")
    if k is not None and k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if token_budget is not None:
        smallest = int(block_tokens.min())
        if token_budget < smallest:
            raise ValueError(
                f"token_budget {token_budget} is smaller than the smallest block "
                f"({smallest} tokens): no block would fit"
            )

    ids = np.arange(len(scores))
    ranked = np.lexsort((ids, -scores))  # last key is primary: score desc, then id asc
    if token_budget is None:
        return ranked[:k].tolist()

    chosen: list[int] = []
    left = token_budget
    for b in ranked.tolist():
        if block_tokens[b] <= left:
            chosen.append(b)
            left -= int(block_tokens[b])
            if len(chosen) == k or left < smallest:
                break
    return chosen


def order_blocks(
    block_ids: Sequence[int], scores: np.ndarray, order: Order = "score"
) -> list[int]:
    """Arrange selected blocks for the prompt.

    ``"score"`` puts the most relevant block last, right before the query,
    where a causal model attends to it most; ``"corpus"`` keeps the stored
    order (ascending block id). Ties are ordered so that ``"score"`` is
    exactly the reverse of the ranking :func:`select_blocks` uses.
    """
    ids = [int(b) for b in block_ids]
    if order == "corpus":
        return sorted(ids)
    if order == "score":
        scores = np.asarray(scores, dtype=np.float64)
        ranked = sorted(ids, key=lambda b: (-scores[b], b))
        return ranked[::-1]
    raise ValueError(f"order must be 'score' or 'corpus', got {order!r}")


class BM25BlockRetriever:
    """BM25 over individual demonstrations, aggregated to blocks.

    One BM25 document per demonstration (not per block) so that one highly
    relevant demonstration can lift its block even when its 31 neighbours are
    unrelated; ``aggregate="max"`` keeps exactly that behaviour, while
    ``"sum-top-n"`` rewards blocks holding several good matches.

    Scores are rank_bm25's BM25Okapi's, from a :class:`~milo_store.text_index.TextIndex`:
    built here from ``texts``, or the one a store keeps (:func:`store_retriever`). A query
    costs its terms' postings plus one pass over the demonstrations' scores.
    """

    def __init__(
        self,
        texts: Sequence[str],
        example_block: Sequence[int],
        block_tokens: Sequence[int],
        aggregate: Aggregate = "max",
        top_n: int = 3,
    ) -> None:
        if len(texts) == 0:
            raise ValueError("cannot build a retriever over an empty corpus")
        index = TextIndex(build_text_index(texts, example_block, len(block_tokens)))
        self._setup(index, index.block_starts, block_tokens, aggregate, top_n)

    @classmethod
    def from_index(cls, index: TextIndex, group_starts: np.ndarray, group_tokens: Sequence[int],
                   aggregate: Aggregate = "max", top_n: int = 3) -> "BM25BlockRetriever":
        """Over an index whose demonstrations of group g are ``[group_starts[g], group_starts[g + 1])``."""
        self = cls.__new__(cls)
        self._setup(index, group_starts, group_tokens, aggregate, top_n)
        return self

    def _setup(self, index: TextIndex, group_starts, block_tokens, aggregate: str, top_n: int) -> None:
        if aggregate not in ("max", "sum-top-n"):
            raise ValueError(f"aggregate must be 'max' or 'sum-top-n', got {aggregate!r}")
        if top_n < 1:
            raise ValueError(f"top_n must be at least 1, got {top_n}")
        tokens = np.asarray(block_tokens, dtype=np.int64)
        starts = np.asarray(group_starts, dtype=np.int64)
        if len(tokens) == 0 or starts.shape != (len(tokens) + 1,) or starts[-1] != index.num_docs:
            raise ValueError(f"need {len(tokens) + 1} group starts ending at {index.num_docs} demonstrations, "
                             f"one group per entry of block_tokens")
        counts = np.diff(starts)
        if (counts <= 0).any():
            empty = np.flatnonzero(counts <= 0)[:5].tolist()
            raise ValueError(f"blocks without any demonstration, e.g. {empty}")
        if (tokens < 1).any():
            raise ValueError("every block must occupy at least one token")
        self.index = index
        self._block_tokens = tokens
        self._block_tokens.setflags(write=False)
        self._starts = starts[:-1]
        self._counts = counts
        self.aggregate = aggregate
        self.top_n = top_n
        self._last: tuple[str, np.ndarray] | None = None

    @property
    def block_tokens(self) -> np.ndarray:
        return self._block_tokens

    @property
    def n_blocks(self) -> int:
        return len(self._block_tokens)

    def example_scores(self, query: str) -> np.ndarray:
        """BM25 score of every demonstration for ``query``, demonstrations in block order
        (stable: a block's demonstrations keep their corpus order)."""
        return self.index.doc_scores(query)

    def matches(self, query: str) -> bool:
        """Whether any term of ``query`` occurs in a demonstration. Without one every block scores 0 and
        the blocks selected are arbitrary (the lowest ids), which the caller should say."""
        return any(self.index.term_id(term) is not None for term in tokenize(query))

    def scores(self, query: str) -> np.ndarray:
        """One score per block (read-only array indexed by block id).

        The last query's scores are kept so that ``select`` followed by
        ``order_blocks(ids, scores(query))`` runs BM25 only once.
        """
        last = self._last  # read once: planners on several threads share this retriever
        if last is not None and last[0] == query:
            return last[1]
        grouped = self.example_scores(query)  # already grouped: block b's demonstrations are contiguous
        if self.aggregate == "max":
            block_scores = np.maximum.reduceat(grouped, self._starts)
        else:
            # Sort scores descending within each block (block stays the primary key), keep each block's n best.
            block_of = np.repeat(np.arange(self.n_blocks), self._counts)
            within = np.lexsort((-grouped, block_of))
            best = np.arange(len(grouped)) - np.repeat(self._starts, self._counts) < self.top_n
            block_scores = np.bincount(block_of[best], weights=grouped[within][best], minlength=self.n_blocks)
        block_scores.setflags(write=False)
        self._last = (query, block_scores)
        return block_scores

    def select(
        self, query: str, k: int | None = None, token_budget: int | None = None
    ) -> list[int]:
        """Most relevant block ids first; see :func:`select_blocks` for the limits."""
        return select_blocks(self.scores(query), self._block_tokens, k, token_budget)


def store_retriever(store: MiloStore, aggregate: Aggregate = "max", top_n: int = 3) -> BM25BlockRetriever:
    """The retriever over a mounted store's groups, from the BM25 index the store keeps (memory-mapped,
    its checksums checked when the store verifies); a store written before it (or with an index of
    another version) is indexed now, with a warning, and answers the same. A format-4 store's index is
    its vocabulary and its text segments' postings (`MiloStore.segmented_index`)."""
    index, why = (store.segmented_index(), "no BM25 index") if store.segmented else format3_index(store)
    if index is None:
        warnings.warn(f"{store.path} has {why}: indexing its {store.num_examples()} demonstrations at mount "
                      f"(rebuild the store to skip this)", stacklevel=2)
        ex = store.examples()
        index = TextIndex(build_text_index(ex["input"], ex["block"], store.num_blocks))
    group_starts = index.block_starts[np.searchsorted(store.block_group, np.arange(store.num_groups + 1))]
    return BM25BlockRetriever.from_index(index, group_starts, store.group_tokens(), aggregate, top_n)


def format3_index(store: MiloStore) -> tuple[TextIndex | None, str]:
    """The index a format-3 store keeps (None, and why, when it keeps none of this version)."""
    found = store.index_arrays(text_index.NAME)
    if found is None or {k: found[0].get(k) for k in text_index.index_attrs()} != text_index.index_attrs():
        return None, "no BM25 index" if found is None else f"a BM25 index of another version ({found[0].get('version')})"
    try:
        index = TextIndex(found[1])
    except ValueError as e:
        raise StoreCorruptedError(f"{store.path}: broken BM25 index ({e})") from e
    if index.num_docs != store.num_examples() or len(index.block_starts) != store.num_blocks + 1:
        raise StoreCorruptedError(f"{store.path}: its BM25 index covers {index.num_docs} demonstrations in "
                                  f"{len(index.block_starts) - 1} blocks, the store has {store.num_examples()} "
                                  f"in {store.num_blocks}")
    return index, ""
