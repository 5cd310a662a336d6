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

import re
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np
from rank_bm25 import BM25Okapi

Aggregate = Literal["max", "sum-top-n"]
Order = Literal["score", "corpus"]

# Runs of letters and digits (any script); everything else, "_" included, splits.
_WORD = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """Lowercase ``text`` and split it on anything that is not a letter or digit.

    Deliberately simple and deterministic: the same text always gives the same
    terms, whatever the model or platform, so BM25 rankings are reproducible.
    """
    return _WORD.findall(text.lower())


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

    Build it once when the store is mounted: construction indexes the whole
    corpus, while a query costs one BM25 pass plus a few numpy reductions.
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
        if len(texts) != len(example_block):
            raise ValueError(
                f"{len(texts)} texts but {len(example_block)} block assignments; "
                "need one block id per demonstration"
            )
        if aggregate not in ("max", "sum-top-n"):
            raise ValueError(f"aggregate must be 'max' or 'sum-top-n', got {aggregate!r}")
        if top_n < 1:
            raise ValueError(f"top_n must be at least 1, got {top_n}")

        block_of = np.asarray(example_block, dtype=np.int64)
        tokens = np.asarray(block_tokens, dtype=np.int64)
        n_blocks = len(tokens)
        if n_blocks == 0 or block_of.min() < 0 or block_of.max() >= n_blocks:
            raise ValueError(
                f"block ids must lie in [0, {n_blocks}), the range block_tokens covers; "
                f"got ids from {block_of.min()} to {block_of.max()}"
            )
        counts = np.bincount(block_of, minlength=n_blocks)
        if (counts == 0).any():
            empty = np.flatnonzero(counts == 0)[:5].tolist()
            raise ValueError(f"blocks without any demonstration, e.g. {empty}")
        if (tokens < 1).any():
            raise ValueError("every block must occupy at least one token")

        docs = [tokenize(t) for t in texts]
        if not any(docs):
            raise ValueError("no demonstration contains a single letter or digit to index")
        self._bm25 = BM25Okapi(docs)
        self._block_tokens = tokens
        self._block_tokens.setflags(write=False)
        self.aggregate = aggregate
        self.top_n = top_n

        # Group demonstrations by block once, so per-query aggregation is a
        # gather plus a segmented reduction instead of a loop over examples.
        self._by_block = np.argsort(block_of, kind="stable")
        sorted_blocks = block_of[self._by_block]
        self._starts = np.flatnonzero(np.r_[True, sorted_blocks[1:] != sorted_blocks[:-1]])
        self._sorted_blocks = sorted_blocks
        # Position of each (block-sorted) demonstration inside its block, used
        # to keep each block's n best once scores are sorted within blocks.
        rank_in_block = np.arange(len(block_of)) - np.repeat(self._starts, counts)
        self._in_top_n = rank_in_block < top_n

        self._last: tuple[str, np.ndarray] | None = None

    @property
    def block_tokens(self) -> np.ndarray:
        return self._block_tokens

    @property
    def n_blocks(self) -> int:
        return len(self._block_tokens)

    def example_scores(self, query: str) -> np.ndarray:
        """BM25 score of every demonstration for ``query``."""
        # Terms absent from the corpus score zero anyway; dropping them first
        # skips rank_bm25's pass over every document for each such term.
        terms = [t for t in tokenize(query) if t in self._bm25.idf]
        return self._bm25.get_scores(terms)

    def scores(self, query: str) -> np.ndarray:
        """One score per block (read-only array indexed by block id).

        The last query's scores are kept so that ``select`` followed by
        ``order_blocks(ids, scores(query))`` runs BM25 only once.
        """
        if self._last is not None and self._last[0] == query:
            return self._last[1]
        grouped = self.example_scores(query)[self._by_block]
        if self.aggregate == "max":
            block_scores = np.maximum.reduceat(grouped, self._starts)
        else:
            # Sort scores descending within each block (block stays the primary
            # key, so the block-sorted layout and _in_top_n still line up).
            within = np.lexsort((-grouped, self._sorted_blocks))
            best = self._in_top_n
            block_scores = np.bincount(
                self._sorted_blocks[best], weights=grouped[within][best], minlength=self.n_blocks
            )
        block_scores.setflags(write=False)
        self._last = (query, block_scores)
        return block_scores

    def select(
        self, query: str, k: int | None = None, token_budget: int | None = None
    ) -> list[int]:
        """Most relevant block ids first; see :func:`select_blocks` for the limits."""
        return select_blocks(self.scores(query), self._block_tokens, k, token_budget)
