"""The BM25 index a store keeps: its scores against rank_bm25, named index arrays round trip, corruption."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

from milo_store import CompressionConfig, MiloStore, StoreCorruptedError, StoreWriter, text_index
from milo_store.synthetic import build_synthetic_store
from milo_store.text_index import TextIndex, build_text_index, tokenize

from .conftest import LAYOUT, TOKENS

WORDS = ["card", "lost", "top", "up", "rate", "fee", "pin", "atm", "über"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.sampled_from(WORDS), max_size=7), min_size=1, max_size=25),
       st.lists(st.sampled_from(WORDS + ["unseen"]), max_size=5), st.randoms(use_true_random=False))
def test_scores_are_bm25okapis_bit_for_bit(docs, query, rnd):
    """Every demonstration's score equals rank_bm25's exactly (same float64 sums), in block order."""
    blocks = [rnd.randrange(4) for _ in docs]
    texts = [" ".join(d) for d in docs]
    if not any(docs):
        with pytest.raises(ValueError, match="letter or digit"):
            build_text_index(texts, blocks, 4)
        return
    index = TextIndex(build_text_index(texts, blocks, 4))
    expected = BM25Okapi([tokenize(t) for t in texts]).get_scores(query)
    order = np.argsort(blocks, kind="stable")
    np.testing.assert_array_equal(index.doc_scores(" ".join(query)), expected[order])
    assert index.block_starts.tolist() == np.searchsorted(np.sort(blocks), np.arange(5)).tolist()


def test_vocabulary_lookup_finds_every_term_and_nothing_else():
    index = TextIndex(build_text_index(["b a c", "ä zz a"], [0, 0], 1))
    found = {t: index.term_id(t) for t in ("a", "b", "c", "zz", "ä")}
    assert sorted(found.values()) == list(range(5))
    assert [index.term_id(t) for t in ("", "aa", "0", "zzz", "ö")] == [None] * 5


@settings(max_examples=15, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]),
                       st.sampled_from(["int32", "int64", "float64", "uint8"]).flatmap(
                           lambda dt: st.lists(st.integers(0, 200), max_size=50).map(lambda v: np.array(v, dtype=dt))),
                       max_size=3))
def test_named_index_arrays_round_trip(tmp_path_factory, arrays):
    path = tmp_path_factory.mktemp("s") / "store"
    with StoreWriter(path, LAYOUT, np.zeros((1, 3, 2, 2), dtype=np.int16), [4]) as w:
        w.write_block(torch.zeros(0, dtype=torch.float16))
        w.write_index("things", arrays, {"version": 7})
        w.commit()
    with MiloStore.open(path, tier="disk") as store:
        assert store.index_names() == ["things"]
        attrs, got = store.index_arrays("things")
        assert attrs["version"] == 7 and set(got) == set(arrays)
        for k, a in arrays.items():
            assert got[k].dtype == a.dtype and np.array_equal(got[k], a)
            assert not got[k].flags.writeable
        assert store.index_arrays("other") is None


@pytest.fixture
def indexed_store(tmp_path):
    texts = ["lost my card", "card lost again", "top up failed", "exchange rate", "rate for dollars", "pin blocked"]
    return build_synthetic_store(tmp_path / "store", LAYOUT, TOKENS, CompressionConfig(ratio=0.5), seed=1,
                                 texts=texts, example_block=[0, 0, 1, 2, 2, 3])


def test_a_built_store_keeps_the_index_of_its_demonstrations(indexed_store):
    """Format 4: the corpus-wide vocabulary, and each segment's postings, are those its demonstrations give,
    and together they score as the format-3 index of the same demonstrations does, to the bit."""
    with MiloStore.open(indexed_store, tier="disk") as store:
        attrs, arrays = store.index_arrays(text_index.NAME)
        assert {k: attrs[k] for k in text_index.index_attrs() if k != "version"} == {
            k: v for k, v in text_index.index_attrs().items() if k != "version"}
        ex = store.examples()
        fresh, stats = text_index.vocabulary(ex["input"])
        assert set(arrays) == set(text_index.VOCABULARY_ARRAYS) and attrs["version"] == text_index.SEGMENTED_VERSION
        assert all(np.array_equal(arrays[k], fresh[k]) for k in text_index.VOCABULARY_ARRAYS)
        assert {k: attrs[k] for k in stats} == stats and store.num_examples() == 6
        index, whole = store.segmented_index(), TextIndex(build_text_index(ex["input"], ex["block"], store.num_blocks))
        for query in ("lost card", "rate rate dollars", "pin", "nothing here"):
            np.testing.assert_array_equal(index.doc_scores(query), whole.doc_scores(query))
        assert index.block_starts.tolist() == whole.block_starts.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(WORDS), max_size=7), min_size=1, max_size=25),
       st.lists(st.sampled_from(WORDS + ["unseen"]), max_size=5), st.randoms(use_true_random=False))
def test_segmented_scores_are_bm25okapis_bit_for_bit(docs, query, rnd):
    """Cut into segments anywhere, per-document postings combined with the corpus-wide idf at query time
    give BM25Okapi's scores exactly."""
    texts = [" ".join(d) for d in docs]
    if not any(docs):
        return
    cuts = sorted({0, len(texts), *(rnd.randrange(len(texts) + 1) for _ in range(3))})
    vocabulary, attrs = text_index.vocabulary(texts)
    postings = [text_index.segment_postings(texts[a:z]) for a, z in zip(cuts, cuts[1:])]
    index = text_index.SegmentedTextIndex(vocabulary, attrs, postings, np.array([0, len(texts)]))
    expected = BM25Okapi([tokenize(t) for t in texts]).get_scores(query)
    np.testing.assert_array_equal(index.doc_scores(" ".join(query)), expected)
    assert all((index.term_id(w) is None) == (w not in " ".join(texts).split()) for w in WORDS + ["unseen"])


def test_a_segmented_query_searches_only_the_vocabulary_and_reads_the_segments_vocabularies_once(monkeypatch):
    """Format 4's queries were ~20x slower than format 3's at 90k demonstrations (docs/benchmarks.md): each
    query term was binary-searched again in every segment's own vocabulary. A query searches the corpus
    vocabulary once per term and no segment's; the segments' vocabularies are read whole once, at the first
    query, into the index's term table."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 8))) for _ in range(200)]
    vocabulary, attrs = text_index.vocabulary(texts)
    postings = [text_index.segment_postings(texts[a:a + 25]) for a in range(0, 200, 25)]
    index = text_index.SegmentedTextIndex(vocabulary, attrs, postings, np.array([0, len(texts)]))
    names = {index.term_id(w): w for w in WORDS}
    searched, read = [], []
    find, keys = text_index.SortedTerms.find, text_index.SortedTerms.keys
    monkeypatch.setattr(text_index.SortedTerms, "find", lambda self, term: searched.append(self) or find(self, term))
    monkeypatch.setattr(text_index.SortedTerms, "keys", lambda self: read.append(self) or keys(self))
    weighed = []
    weigh = text_index.SegmentedTextIndex._weigh
    monkeypatch.setattr(text_index.SegmentedTextIndex, "_weigh",
                        lambda self, ids: weighed.append(sorted(names[t] for t in ids))
                        or weigh(self, ids))
    oracle = BM25Okapi([tokenize(t) for t in texts])
    for query, new_terms in (("lost card", ["card", "lost"]), ("card card pin über", ["pin", "über"]),
                             ("unseen", None), ("atm fee top up rate", ["atm", "fee", "rate", "top", "up"]),
                             ("lost card card", None)):
        searched.clear()
        weighed.clear()
        np.testing.assert_array_equal(index.doc_scores(query), oracle.get_scores(tokenize(query)))
        assert searched == [index.vocabulary] * len(tokenize(query)), query
        assert weighed == ([new_terms] if new_terms else []), query  # postings read once per term, then kept
    assert len(read) == 1 + len(postings)  # at the first query that found a term, never again
    assert {id(r) for r in read} == {id(index.vocabulary), *(id(seg[1]) for seg in index.segments)}


def test_segmented_scores_stay_bm25okapis_when_the_postings_cache_overflows(monkeypatch):
    monkeypatch.setattr(text_index, "CACHED_POSTING_BYTES", 600)  # a few small terms, evicted as others come
    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 8))) for _ in range(120)]
    vocabulary, attrs = text_index.vocabulary(texts)
    postings = [text_index.segment_postings(texts[a:a + 40]) for a in range(0, 120, 40)]
    index = text_index.SegmentedTextIndex(vocabulary, attrs, postings, np.array([0, len(texts)]))
    oracle = BM25Okapi([tokenize(t) for t in texts])
    for _ in range(30):
        query = list(rng.choice(WORDS, size=rng.integers(1, 6)))
        np.testing.assert_array_equal(index.doc_scores(" ".join(query)), oracle.get_scores(query))
        assert index._cached_bytes <= 600 and index._cached_bytes == sum(d.nbytes + w.nbytes for d, w in index._cache.values())
    assert index._cache  # some terms fit


def test_corrupted_index_bytes_are_named_at_map_and_by_verify(indexed_store):
    weights = indexed_store / "indexes" / "bm25" / "idf" / "c" / "0"
    raw = bytearray(weights.read_bytes())
    raw[3] ^= 0x10
    weights.write_bytes(bytes(raw))
    with MiloStore.open(indexed_store, tier="disk") as store:
        with pytest.raises(StoreCorruptedError, match="idf fails its checksum"):
            store.index_arrays(text_index.NAME)
        assert store.index_arrays(text_index.NAME, check=False) is not None  # what `ls` maps without checking
        problems = store.verify_all()
        assert len(problems) == 1 and "idf" in problems[0]


def test_truncated_index_file_is_refused_even_unchecked(indexed_store):
    starts = indexed_store / "indexes" / "bm25" / "term_starts" / "c" / "0"
    starts.write_bytes(starts.read_bytes()[:-4])
    with MiloStore.open(indexed_store, tier="disk", verify=False) as store:
        with pytest.raises(StoreCorruptedError, match="term_starts's chunk file is missing or truncated"):
            store.index_arrays(text_index.NAME)
