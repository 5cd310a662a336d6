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

A format-4 store keeps the index in two parts, so that an update rewrites neither whole
(``SegmentedTextIndex``): what depends on the whole corpus, the sorted vocabulary and each term's idf
(``vocabulary``, in ``indexes/bm25`` with the number of demonstrations and their summed length), and
what is per document, each text segment's own sorted vocabulary with its postings of (document, term
frequency) and its documents' lengths (``segment_postings``, in the segment's file). A query combines
them into the same weights, by the same float64 expression.
"""
import math
import re
from collections.abc import Sequence

import numpy as np

NAME = "bm25"
VERSION = 1  # bump when tokenize, the parameters or the arrays change: older indexes are rebuilt at mount
SEGMENTED_VERSION = 2  # format 4: the vocabulary and idf here, per-document postings in each text segment
K1, B, EPSILON = 1.5, 0.75, 0.25
ARRAYS = ("terms", "term_starts", "posting_starts", "posting_docs", "posting_weights", "block_starts")
VOCABULARY_ARRAYS = ("terms", "term_starts", "idf")
SEGMENT_ARRAYS = ("terms", "term_starts", "posting_starts", "posting_docs", "posting_tf", "doc_lengths")

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


def _count(texts: Sequence[str]):
    """(vocabulary {term: id} in order of first occurrence, each (document, term) pair's document, term and
    count, each document's length in terms). First occurrence is BM25Okapi's order for summing the idfs
    (float sums depend on it)."""
    ids: dict[str, int] = {}
    token_ids, lengths = [], np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        doc = [ids.setdefault(t, len(ids)) for t in tokenize(text)]
        token_ids.extend(doc)
        lengths[i] = len(doc)
    vocab = max(1, len(ids))
    doc_of_token = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)
    pairs, tf = np.unique(doc_of_token * vocab + np.asarray(token_ids, dtype=np.int64), return_counts=True)
    pair_doc, pair_term = np.divmod(pairs, vocab)
    return ids, pair_doc, pair_term, tf, lengths


def _okapi_idf(document_frequencies: list[int], n: int) -> np.ndarray:
    """BM25Okapi's idf of each term (in first-occurrence order), negative ones floored at epsilon × the mean."""
    idf = [math.log(n - df + 0.5) - math.log(df + 0.5) for df in document_frequencies]
    total = 0.0
    for x in idf:  # a plain loop, as BM25Okapi's: sum() compensates rounding (Python 3.12+), which changes the last bit
        total += x
    floor = EPSILON * (total / len(idf))
    return np.array([floor if x < 0 else x for x in idf])


def _okapi_weights(idf, tf, dl, avgdl: float):
    """BM25Okapi's term weight, the float64 expression its ``get_scores`` evaluates, element by element."""
    return idf * (tf * (K1 + 1) / (tf + K1 * (1 - B + B * dl / avgdl)))


def _sorted_terms(ids: dict[str, int]) -> tuple[list[str], np.ndarray, dict[str, np.ndarray]]:
    """(terms sorted bytewise, each first-occurrence id's rank among them, the vocabulary arrays)."""
    terms = sorted(ids)
    rank = np.empty(len(ids), dtype=np.int64)
    rank[[ids[t] for t in terms]] = np.arange(len(ids))
    encoded = [t.encode() for t in terms]
    arrays = {"terms": np.frombuffer(b"".join(encoded), dtype=np.uint8),
              "term_starts": np.concatenate(([0], np.cumsum([len(e) for e in encoded]))).astype(np.int64)}
    return terms, rank, arrays


def _check_corpus(texts, example_block, num_blocks) -> np.ndarray:
    if len(texts) != len(example_block):
        raise ValueError(f"{len(texts)} texts but {len(example_block)} block assignments; "
                         "need one block id per demonstration")
    if len(texts) == 0:
        raise ValueError("cannot index an empty corpus")
    block_of = np.asarray(example_block, dtype=np.int64)
    if block_of.min() < 0 or block_of.max() >= num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks}); got ids from {block_of.min()} to {block_of.max()}")
    return block_of


def build_text_index(texts: Sequence[str], example_block: Sequence[int], num_blocks: int) -> dict[str, np.ndarray]:
    """The index arrays for these demonstrations (``example_block[i]``: the block of ``texts[i]``), as a
    format-3 store keeps them (and a mount builds them for a store without an index)."""
    block_of = _check_corpus(texts, example_block, num_blocks)
    ids, pair_doc, pair_term, tf, lengths = _count(texts)
    if not ids:
        raise ValueError("no demonstration contains a single letter or digit to index")
    n, vocab = len(texts), len(ids)
    idf = _okapi_idf(np.bincount(pair_term, minlength=vocab).tolist(), n)
    weights = _okapi_weights(idf[pair_term], tf, lengths[pair_doc], int(lengths.sum()) / n)

    order = np.argsort(block_of, kind="stable")  # demonstrations renumbered in block order
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    _, rank, arrays = _sorted_terms(ids)
    term, doc = rank[pair_term], position[pair_doc]
    by_term = np.lexsort((doc, term))
    return {
        **arrays,
        "posting_starts": np.searchsorted(term[by_term], np.arange(vocab + 1)).astype(np.int64),
        "posting_docs": doc[by_term].astype(np.int32),
        "posting_weights": weights[by_term],
        "block_starts": np.searchsorted(block_of[order], np.arange(num_blocks + 1)).astype(np.int64),
    }


def segmented_attrs(documents: int, total_length: int) -> dict:
    """What a format-4 store's vocabulary (``indexes/bm25``) records: how it was built, and the corpus
    statistics BM25's weights take (documents, their summed length in terms)."""
    return {**index_attrs(), "version": SEGMENTED_VERSION, "documents": documents, "total_length": total_length}


def vocabulary(texts: Sequence[str]) -> tuple[dict[str, np.ndarray], dict]:
    """The corpus-wide part of a segmented index over ``texts`` (every demonstration, in store order): the
    vocabulary sorted, each term's idf, and the attributes (`segmented_attrs`)."""
    ids, _, pair_term, _, lengths = _count(texts)
    if not ids:
        raise ValueError("no demonstration contains a single letter or digit to index")
    idf = _okapi_idf(np.bincount(pair_term, minlength=len(ids)).tolist(), len(texts))
    _, rank, arrays = _sorted_terms(ids)
    sorted_idf = np.empty(len(ids))
    sorted_idf[rank] = idf
    return {**arrays, "idf": sorted_idf}, segmented_attrs(len(texts), int(lengths.sum()))


def segment_postings(texts: Sequence[str]) -> dict[str, np.ndarray]:
    """The per-document part of a segmented index over one segment's demonstrations (in store order): its
    own sorted vocabulary, each term's postings (local document, term frequency), each document's length."""
    ids, pair_doc, pair_term, tf, lengths = _count(texts)
    _, rank, arrays = _sorted_terms(ids)
    term = rank[pair_term]
    by_term = np.lexsort((pair_doc, term))
    return {**arrays, "posting_starts": np.searchsorted(term[by_term], np.arange(len(ids) + 1)).astype(np.int64),
            "posting_docs": pair_doc[by_term].astype(np.int32), "posting_tf": tf[by_term].astype(np.int32),
            "doc_lengths": lengths.astype(np.int32)}


class SortedTerms:
    """Binary search of a sorted vocabulary held as UTF-8 bytes and their starts (touches about log2(V) entries)."""

    def __init__(self, terms: np.ndarray, term_starts: np.ndarray):
        self.terms, self.term_starts = terms, term_starts

    def find(self, term: str) -> int | None:
        key, lo, hi = term.encode(), 0, len(self.term_starts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.terms[self.term_starts[mid]:self.term_starts[mid + 1]].tobytes() < key:
                lo = mid + 1
            else:
                hi = mid
        found = lo < len(self.term_starts) - 1 and self.terms[self.term_starts[lo]:self.term_starts[lo + 1]].tobytes() == key
        return lo if found else None


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
        return SortedTerms(self.terms, self.term_starts).find(term)

    def doc_scores(self, query: str) -> np.ndarray:
        """BM25 score of every demonstration (in block order) for ``query``; terms absent from the corpus add nothing."""
        scores = np.zeros(self.num_docs)
        for term in tokenize(query):
            t = self.term_id(term)
            if t is not None:
                start, stop = int(self.posting_starts[t]), int(self.posting_starts[t + 1])
                scores[self.docs[start:stop]] += self.weights[start:stop]
        return scores


class SegmentedTextIndex:
    """Query side of a format-4 store's index: the corpus-wide vocabulary and idf, and each text segment's
    postings, combined at query time into BM25Okapi's scores to the bit (the weight is the same float64
    expression of the same idf, term frequency, length and mean length that a format-3 index precomputes,
    and a query adds its terms' weights in query order, segment by segment: every document is in one)."""

    def __init__(self, vocabulary: dict[str, np.ndarray], attrs: dict, segments: list[dict[str, np.ndarray]],
                 block_starts: np.ndarray):
        """``segments``: each one's postings (`segment_postings`), in store order; ``block_starts``: every
        block's first demonstration, and the end."""
        self.vocabulary = SortedTerms(vocabulary["terms"], vocabulary["term_starts"])
        self.idf = vocabulary["idf"]
        self.num_docs = int(attrs["documents"])
        self.avgdl = int(attrs["total_length"]) / self.num_docs if self.num_docs else 0.0
        self.block_starts = block_starts
        self.segments, first = [], 0
        for seg in segments:
            self.segments.append((first, SortedTerms(seg["terms"], seg["term_starts"]), seg["posting_starts"],
                                  seg["posting_docs"], seg["posting_tf"], seg["doc_lengths"]))
            first += len(seg["doc_lengths"])
        if first != self.num_docs or len(self.idf) != len(vocabulary["term_starts"]) - 1 or int(block_starts[-1]) != first:
            raise ValueError(f"segments hold {first} demonstrations, the vocabulary counts {self.num_docs} and the "
                             f"blocks {int(block_starts[-1])}")

    def term_id(self, term: str) -> int | None:
        return self.vocabulary.find(term)

    def doc_scores(self, query: str) -> np.ndarray:
        """BM25 score of every demonstration (in store order) for ``query``; terms absent from the corpus add nothing."""
        scores = np.zeros(self.num_docs)
        for term in tokenize(query):
            t = self.vocabulary.find(term)
            if t is None:
                continue
            idf = self.idf[t]
            for first, terms, starts, docs, tf, lengths in self.segments:
                local = terms.find(term)
                if local is not None:
                    a, z = int(starts[local]), int(starts[local + 1])
                    d = docs[a:z]
                    scores[first + d] += _okapi_weights(idf, tf[a:z], lengths[d], self.avgdl)
        return scores
