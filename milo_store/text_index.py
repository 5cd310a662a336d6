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
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

NAME = "bm25"
VERSION = 1  # bump when tokenize, the parameters or the arrays change: older indexes are rebuilt at mount
SEGMENTED_VERSION = 2  # format 4: the vocabulary and idf here, per-document postings in each text segment
K1, B, EPSILON = 1.5, 0.75, 0.25
ARRAYS = ("terms", "term_starts", "posting_starts", "posting_docs", "posting_weights", "block_starts")
VOCABULARY_ARRAYS = ("terms", "term_starts", "idf")
CACHED_POSTING_BYTES = 32 << 20  # per format-4 index: the weighed postings of the terms queried last
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
    return idf * _okapi_saturation(tf, dl, avgdl)


def _okapi_saturation(tf, dl, avgdl: float):
    """The factor of BM25Okapi's weight beside the idf (what a term frequency ``tf`` in a document of ``dl`` terms counts)."""
    return tf * (K1 + 1) / (tf + K1 * (1 - B + B * dl / avgdl))


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
        # plain views of the same (mapped) bytes: indexing an np.memmap costs microseconds a step
        self.terms, self.term_starts = terms.view(np.ndarray), term_starts.view(np.ndarray)

    def keys(self) -> list[bytes]:
        """Every term's UTF-8 bytes, in order (reads the whole vocabulary)."""
        data, starts = self.terms.tobytes(), self.term_starts.tolist()
        return [data[a:z] for a, z in zip(starts, starts[1:])]

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
    and each demonstration's weights are added in query order, from 0, as a format-3 query adds them:
    every demonstration is in one segment).

    A query looks its terms up once, in the vocabulary, and finds where their postings lie in the segments
    in a table built at its first query (`TermTable`): a term costs a slice per segment holding it and a few
    array operations over its postings, not a binary search per segment. Its documents and weights are then
    kept (up to `CACHED_POSTING_BYTES`, the terms queried last), so a term asked again, as the common ones
    are, costs what it costs in a format-3 index."""

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
        self._table: TermTable | None = None
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # least recently used first
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def term_id(self, term: str) -> int | None:
        return self.vocabulary.find(term)

    def term_table(self) -> "TermTable":
        """Where each term's postings lie in the segments (`TermTable`): built once, at the first query; threads
        racing build equal tables and one is kept."""
        table = self._table
        if table is None:
            table = self._table = TermTable(self)
        return table

    def doc_scores(self, query: str) -> np.ndarray:
        """BM25 score of every demonstration (in store order) for ``query``; terms absent from the corpus add nothing."""
        ids = [t for t in map(self.vocabulary.find, tokenize(query)) if t is not None]
        if not ids:
            return np.zeros(self.num_docs)
        postings = self._weighted_postings(ids)
        d = np.concatenate([postings[t][0] for t in ids])
        weights = np.concatenate([postings[t][1] for t in ids])
        # bincount adds each demonstration's weights from 0 in their order, the query's: as a format-3 query
        return np.bincount(d, weights, minlength=self.num_docs)

    def _weighted_postings(self, ids: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Each of these terms' postings, as (documents in store order, BM25 weights): from the cache of the
        terms queried last (up to `CACHED_POSTING_BYTES`), the others weighed now."""
        with self._lock:
            found = {t: self._cache[t] for t in set(ids) if t in self._cache}
            for t in found:
                self._cache.move_to_end(t)
        missing = sorted(set(ids) - found.keys())
        if missing:
            weighed = self._weigh(np.array(missing, dtype=np.int64))
            found.update(zip(missing, weighed))
            with self._lock:
                for t, (d, w) in zip(missing, weighed):
                    if t not in self._cache and d.nbytes + w.nbytes <= CACHED_POSTING_BYTES:
                        self._cache[t] = (d, w)
                        self._cached_bytes += d.nbytes + w.nbytes
                while self._cached_bytes > CACHED_POSTING_BYTES:
                    _, (d, w) = self._cache.popitem(last=False)
                    self._cached_bytes -= d.nbytes + w.nbytes
        return found

    def _weigh(self, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per term of ``ids`` (distinct), its postings from every segment as (documents in store order, BM25
        weights, the float64 expression of `_okapi_weights`, so bit for bit)."""
        table = self.term_table()
        runs, runs_per_term = _ranges(table.run_starts[ids], table.run_starts[ids + 1])
        segment, begin, count = table.run_segment[runs], table.run_begin[runs], table.run_count[runs]
        docs = [np.zeros(0, dtype=np.int32)]
        for k, a, z in zip(segment.tolist(), begin.tolist(), (begin + count).tolist()):
            docs.append(self.segments[k][3][a:z])
        d = np.concatenate(docs, dtype=np.int64)
        d += np.repeat(table.segment_first[segment], count)  # store order
        weights = table.saturation_tf1[d]  # most postings count their term once: the others, from the table
        in_all = table.posting_first[segment] + begin  # the runs' first postings among all segments'
        found, per_run = _ranges(np.searchsorted(table.repeated_at, in_all),
                                 np.searchsorted(table.repeated_at, in_all + count))
        at = np.repeat(np.cumsum(count) - count - in_all, per_run) + table.repeated_at[found]
        weights[at] = _okapi_saturation(table.repeated_tf[found], table.lengths[d[at]], self.avgdl)
        weights *= np.repeat(np.repeat(self.idf.view(np.ndarray)[ids], runs_per_term), count)
        per_term = np.bincount(np.repeat(np.arange(len(ids)), runs_per_term), count, len(ids)).astype(np.int64)
        cuts = np.cumsum(per_term)[:-1]
        parts = list(zip(np.split(d, cuts), np.split(weights, cuts)))
        for part in parts:
            for a in part:
                a.flags.writeable = False
        return parts


def _ranges(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the integers of every range [starts[i], stops[i]) concatenated, each range's length)."""
    counts = stops - starts
    ends = np.cumsum(counts)
    return np.arange(ends[-1] if len(ends) else 0) + np.repeat(starts - ends + counts, counts), counts


class TermTable:
    """What lets a query over a `SegmentedTextIndex` take its terms' postings from every segment as slices,
    where a binary search per term and segment made format 4's queries ~9x slower than format 3's
    (docs/benchmarks.md): each vocabulary term's runs of postings, one per segment holding it, in store order
    (``run_starts`` [V + 1] into ``run_segment``, ``run_begin``, ``run_count``); each segment's first
    document and first posting among all segments'; every document's length and its BM25 saturation at
    term frequency 1 (`_okapi_saturation`: most postings' weight over the idf); and the postings whose
    term frequency is not 1 (``repeated_at``, among all segments', and ``repeated_tf``). Reads each
    segment's vocabulary, posting starts, term frequencies and lengths whole, once: ~24 bytes a
    (term, segment), 12 a document and 12 a repeated posting, beside the postings' documents, which stay
    mapped and are read per query."""

    def __init__(self, index: SegmentedTextIndex):
        ids = {key: i for i, key in enumerate(index.vocabulary.keys())}
        terms, segment, begin, count = [np.zeros(0, dtype=np.int64)], [], [], []
        posting_first, repeated_at, repeated_tf = [0], [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int32)]
        for k, (_, vocab, starts, _, tf, _) in enumerate(index.segments):
            found = np.array([ids.get(key, -1) for key in vocab.keys()], dtype=np.int64)
            kept = found >= 0  # a term the vocabulary lacks is never queried
            terms.append(found[kept])
            segment.append(np.full(int(kept.sum()), k, dtype=np.int64))
            begin.append(np.asarray(starts[:-1])[kept])
            count.append(np.diff(starts)[kept])
            repeated = np.flatnonzero(tf != 1)
            repeated_at.append(repeated + posting_first[-1])
            repeated_tf.append(tf[repeated])
            posting_first.append(posting_first[-1] + len(tf))
        term = np.concatenate(terms)
        by_term = np.argsort(term, kind="stable")  # segments stay in store order within a term
        self.run_starts = np.searchsorted(term[by_term], np.arange(len(index.idf) + 1))
        self.run_segment, self.run_begin, self.run_count = (np.concatenate([terms[0], *a])[by_term]
                                                            for a in (segment, begin, count))
        self.segment_first = np.array([first for first, *_ in index.segments], dtype=np.int64)
        self.posting_first = np.array(posting_first[:-1], dtype=np.int64)
        self.repeated_at, self.repeated_tf = np.concatenate(repeated_at), np.concatenate(repeated_tf)
        self.lengths = np.concatenate([np.zeros(0, dtype=np.int32)] + [s[5] for s in index.segments])
        self.saturation_tf1 = _okapi_saturation(1, self.lengths, index.avgdl)
