"""A BM25 index over the demonstrations' text, built once with the store and memory-mapped at mount.

Text only: it knows terms, demonstrations and the store blocks they belong to, nothing about models.
Scores equal ``rank_bm25.BM25Okapi``'s (k1 = 1.5, b = 0.75, epsilon = 0.25) bit for bit: each
(term, demonstration) weight is precomputed with BM25Okapi's float64 expression from the same corpus
statistics, and a query adds its terms' weights in query order, the sums ``get_scores`` makes.
Neither bm25s (idf floored at 0, float32) nor tantivy (Lucene's idf, quantized lengths) reproduces
them (docs/benchmarks.md), so the index is this term-major layout, the one bm25s uses, in numpy.

Arrays (docs/format.md, ``indexes/bm25``), demonstrations numbered in store-block order:

- ``terms`` uint8, ``term_starts`` int64 [V + 1]: the vocabulary, UTF-8, sorted (binary search);
- ``posting_starts`` int64 [V + 1], ``posting_docs`` int32, ``posting_weights`` float64: term t's
  demonstrations and their weights are ``[posting_starts[t], posting_starts[t + 1])``;
- ``block_starts`` int64 [num_blocks + 1]: block b's demonstrations are ``[block_starts[b], block_starts[b + 1])``.

A query touches the vocabulary pages its binary search visits and its terms' postings, so neither
mount nor a query reads the rest of the corpus.
"""
import math
import re
from collections.abc import Sequence

import numpy as np

NAME = "bm25"
VERSION = 1  # bump when tokenize, the parameters or the arrays change: older indexes are rebuilt at mount
K1, B, EPSILON = 1.5, 0.75, 0.25
ARRAYS = ("terms", "term_starts", "posting_starts", "posting_docs", "posting_weights", "block_starts")

# Runs of letters and digits (any script); everything else, "_" included, splits.
_WORD = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """Lowercase ``text`` and split it on anything that is not a letter or digit.

    Deliberately simple and deterministic: the same text always gives the same terms, whatever the
    model or platform, so BM25 rankings are reproducible.
    """
    return _WORD.findall(text.lower())


def index_attrs() -> dict:
    """What a stored index records about how it was built; an index recording anything else is rebuilt."""
    return {"kind": "bm25-okapi", "version": VERSION, "k1": K1, "b": B, "epsilon": EPSILON, "tokenizer": "lower-alnum"}


def build_text_index(texts: Sequence[str], example_block: Sequence[int], num_blocks: int) -> dict[str, np.ndarray]:
    """The index arrays for these demonstrations (``example_block[i]``: the block of ``texts[i]``)."""
    if len(texts) != len(example_block):
        raise ValueError(f"{len(texts)} texts but {len(example_block)} block assignments; "
                         "need one block id per demonstration")
    if len(texts) == 0:
        raise ValueError("cannot index an empty corpus")
    block_of = np.asarray(example_block, dtype=np.int64)
    if block_of.min() < 0 or block_of.max() >= num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks}); got ids from {block_of.min()} to {block_of.max()}")

    # Term ids in order of first occurrence, BM25Okapi's order for summing the idfs (float sums depend on it).
    ids: dict[str, int] = {}
    token_ids, lengths = [], np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        doc = [ids.setdefault(t, len(ids)) for t in tokenize(text)]
        token_ids.extend(doc)
        lengths[i] = len(doc)
    if not ids:
        raise ValueError("no demonstration contains a single letter or digit to index")
    n, vocab = len(texts), len(ids)
    doc_of_token = np.repeat(np.arange(n, dtype=np.int64), lengths)
    pairs, tf = np.unique(doc_of_token * vocab + np.asarray(token_ids, dtype=np.int64), return_counts=True)
    pair_doc, pair_term = np.divmod(pairs, vocab)

    idf = [math.log(n - df + 0.5) - math.log(df + 0.5) for df in np.bincount(pair_term, minlength=vocab).tolist()]
    total = 0.0
    for x in idf:  # a plain loop, as BM25Okapi's: sum() compensates rounding (Python 3.12+), which changes the last bit
        total += x
    floor = EPSILON * (total / vocab)
    idf = np.array([floor if x < 0 else x for x in idf])
    avgdl = int(lengths.sum()) / n
    dl = lengths[pair_doc]
    weights = idf[pair_term] * (tf * (K1 + 1) / (tf + K1 * (1 - B + B * dl / avgdl)))

    order = np.argsort(block_of, kind="stable")  # demonstrations renumbered in block order
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    terms = sorted(ids)
    rank = np.empty(vocab, dtype=np.int64)
    rank[[ids[t] for t in terms]] = np.arange(vocab)
    term, doc = rank[pair_term], position[pair_doc]
    by_term = np.lexsort((doc, term))
    encoded = [t.encode() for t in terms]
    return {
        "terms": np.frombuffer(b"".join(encoded), dtype=np.uint8),
        "term_starts": np.concatenate(([0], np.cumsum([len(e) for e in encoded]))).astype(np.int64),
        "posting_starts": np.searchsorted(term[by_term], np.arange(vocab + 1)).astype(np.int64),
        "posting_docs": doc[by_term].astype(np.int32),
        "posting_weights": weights[by_term],
        "block_starts": np.searchsorted(block_of[order], np.arange(num_blocks + 1)).astype(np.int64),
    }


class TextIndex:
    """Query side of the index, over arrays in memory or memory-mapped from a store."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        missing = [a for a in ARRAYS if a not in arrays]
        if missing:
            raise ValueError(f"text index lacks arrays {missing}")
        self.terms, self.term_starts = arrays["terms"], arrays["term_starts"]
        self.posting_starts, self.docs = arrays["posting_starts"], arrays["posting_docs"]
        self.weights, self.block_starts = arrays["posting_weights"], arrays["block_starts"]
        vocab = len(self.term_starts) - 1
        if (vocab < 1 or len(self.posting_starts) != vocab + 1 or int(self.term_starts[-1]) != len(self.terms)
                or int(self.posting_starts[-1]) != len(self.docs) or len(self.weights) != len(self.docs)
                or len(self.block_starts) < 2):
            raise ValueError("text index arrays disagree in length")
        self.num_docs = int(self.block_starts[-1])

    def term_id(self, term: str) -> int | None:
        """Binary search of the sorted vocabulary (touches about log2(V) of its entries)."""
        key, lo, hi = term.encode(), 0, len(self.term_starts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.terms[self.term_starts[mid]:self.term_starts[mid + 1]].tobytes() < key:
                lo = mid + 1
            else:
                hi = mid
        found = lo < len(self.term_starts) - 1 and self.terms[self.term_starts[lo]:self.term_starts[lo + 1]].tobytes() == key
        return lo if found else None

    def doc_scores(self, query: str) -> np.ndarray:
        """BM25 score of every demonstration (in block order) for ``query``; terms absent from the corpus add nothing."""
        scores = np.zeros(self.num_docs)
        for term in tokenize(query):
            t = self.term_id(term)
            if t is not None:
                start, stop = int(self.posting_starts[t]), int(self.posting_starts[t + 1])
                scores[self.docs[start:stop]] += self.weights[start:stop]
        return scores
