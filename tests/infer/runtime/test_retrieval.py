import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

from milo_infer.runtime.retrieval import (
    BM25BlockRetriever,
    Retriever,
    order_blocks,
    select_blocks,
    store_retriever,
    tokenize,
)

# Four blocks of two demonstrations; only block 2 mentions a lost card.
TEXTS = [
    "how do I top up my account -> top_up",
    "top up failed again -> top_up",
    "my transfer is pending -> pending_transfer",
    "why is the transfer still pending -> pending_transfer",
    "I lost my card yesterday -> card_lost",
    "where is my new card -> card_arrival",
    "exchange rate for euros -> exchange_rate",
    "what rate do you use for dollars -> exchange_rate",
]
BLOCK = [0, 0, 1, 1, 2, 2, 3, 3]
TOKENS = [40, 60, 50, 30]


def retriever(**kw) -> BM25BlockRetriever:
    return BM25BlockRetriever(TEXTS, BLOCK, TOKENS, **kw)


def test_tokenize_lowercases_and_splits_on_non_alphanumerics():
    assert tokenize("Card_Lost, TOP-up 2x!") == ["card", "lost", "top", "up", "2x"]
    assert tokenize("Überweisung fällig") == ["überweisung", "fällig"]
    assert tokenize(" -> ") == []


def test_bm25_retriever_satisfies_protocol():
    assert isinstance(retriever(), Retriever)


def test_top_k_finds_the_relevant_block_first():
    r = retriever()
    assert r.select("I lost my card", k=1) == [2]
    assert r.select("pending transfer", k=2)[0] == 1


def test_ties_are_broken_by_block_id():
    # No query term occurs in the corpus: every block scores 0.
    r = retriever()
    assert r.select("zzz qqq", k=3) == [0, 1, 2]
    assert r.select("", k=4) == [0, 1, 2, 3]


def test_aggregate_max_versus_sum_top_n():
    # Block 0 holds the single best match; block 1 holds three weaker ones.
    texts = [
        "refund refund refund please",
        "hello there",
        "hello again",
        "refund for my order",
        "refund status",
        "is a refund possible",
    ]
    block, tokens = [0, 0, 0, 1, 1, 1], [10, 10]
    by_max = BM25BlockRetriever(texts, block, tokens, aggregate="max")
    by_sum = BM25BlockRetriever(texts, block, tokens, aggregate="sum-top-n", top_n=3)
    assert by_max.select("refund", k=1) == [0]
    assert by_sum.select("refund", k=1) == [1]


def test_token_budget_skips_blocks_that_do_not_fit():
    r = retriever()
    query = "card top up transfer exchange"
    assert r.select(query, k=4) == [0, 1, 3, 2]  # premise; TOKENS = 40, 60, 50, 30
    # 70 tokens: block 0 (40) fits, block 1 (60) no longer does, block 3 (30) still does.
    assert r.select(query, token_budget=70) == [0, 3]
    assert r.select(query, token_budget=1000) == [0, 1, 3, 2]


def test_k_and_budget_together_apply_both_limits():
    r = retriever()
    assert r.select("card", k=1, token_budget=1000) == [2]
    assert len(r.select("card", k=3, token_budget=1000)) == 3
    assert sum(TOKENS[b] for b in r.select("card", k=3, token_budget=90)) <= 90


def test_budget_below_smallest_block_names_its_size():
    with pytest.raises(ValueError, match="smallest block .30 tokens"):
        retriever().select("card", token_budget=29)


@pytest.mark.parametrize(
    "args, match",
    [
        (([], [], [10]), "empty corpus"),
        ((TEXTS, BLOCK[:-1], TOKENS), "8 texts but 7"),
        ((TEXTS, BLOCK, TOKENS[:3]), r"\[0, 3\)"),
        ((TEXTS, [0, 0, 1, 1, 3, 3, 3, 3], TOKENS), r"without any demonstration, e.g. \[2\]"),
        ((TEXTS, BLOCK, [40, 0, 50, 30]), "at least one token"),
        ((["!!", "->"], [0, 0], [5]), "letter or digit"),
    ],
)
def test_construction_errors(args, match):
    with pytest.raises(ValueError, match=match):
        BM25BlockRetriever(*args)


def test_option_errors():
    with pytest.raises(ValueError, match="aggregate"):
        retriever(aggregate="mean")
    with pytest.raises(ValueError, match="top_n"):
        retriever(aggregate="sum-top-n", top_n=0)
    r = retriever()
    with pytest.raises(ValueError, match="k must be at least 1"):
        r.select("card", k=0)
    with pytest.raises(ValueError, match="give k, token_budget"):
        r.select("card")


def test_scores_are_cached_read_only_and_deterministic():
    r = retriever()
    s = r.scores("lost card")
    assert r.scores("lost card") is s
    with pytest.raises(ValueError):
        s[0] = 1.0
    assert np.array_equal(retriever().scores("lost card"), s)
    assert not np.array_equal(r.scores("exchange rate"), s)


def test_order_blocks():
    scores = np.array([0.5, 2.0, 1.0, 1.0])
    assert order_blocks([1, 2, 3, 0], scores, "score") == [0, 3, 2, 1]
    assert order_blocks([3, 1, 0], scores, "corpus") == [0, 1, 3]
    with pytest.raises(ValueError, match="order"):
        order_blocks([0], scores, "random")


def test_score_order_is_the_reverse_of_the_ranking():
    r = retriever()
    ids = r.select("card transfer", k=4)
    assert order_blocks(ids, r.scores("card transfer"), "score") == ids[::-1]


# --- properties -----------------------------------------------------------

WORDS = ["card", "lost", "top", "up", "rate", "fee", "pin", "atm"]


@st.composite
def corpora(draw):
    n_blocks = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 5), min_size=n_blocks, max_size=n_blocks))
    block = [b for b, size in enumerate(sizes) for _ in range(size)]
    block = draw(st.permutations(block))  # demonstrations need not be grouped
    texts = [" ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6))) for _ in block]
    tokens = draw(st.lists(st.integers(1, 100), min_size=n_blocks, max_size=n_blocks))
    query = " ".join(draw(st.lists(st.sampled_from(WORDS + ["unseen"]), max_size=4)))
    return texts, list(block), tokens, query


@settings(max_examples=60, deadline=None)
@given(corpora(), st.integers(1, 4))
def test_vectorised_aggregation_matches_a_plain_loop(corpus, top_n):
    texts, block, tokens, query = corpus
    for aggregate in ("max", "sum-top-n"):
        r = BM25BlockRetriever(texts, block, tokens, aggregate=aggregate, top_n=top_n)
        per_example = np.empty(len(texts))  # example_scores lists demonstrations in block order
        per_example[np.argsort(block, kind="stable")] = r.example_scores(query)
        expected = []
        for b in range(len(tokens)):
            mine = sorted((per_example[i] for i in range(len(texts)) if block[i] == b), reverse=True)
            expected.append(mine[0] if aggregate == "max" else sum(mine[:top_n]))
        np.testing.assert_allclose(r.scores(query), expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-3, 3), min_size=1, max_size=8).flatmap(
        lambda s: st.tuples(
            st.just(s), st.lists(st.integers(1, 50), min_size=len(s), max_size=len(s))
        )
    ),
    st.one_of(st.none(), st.integers(1, 8)),
    st.one_of(st.none(), st.integers(50, 200)),
)
def test_select_blocks_matches_greedy_reference(scores_tokens, k, budget):
    scores, tokens = scores_tokens
    if k is None and budget is None:
        k = 2
    got = select_blocks(np.array(scores, float), np.array(tokens), k=k, token_budget=budget)
    ranked = sorted(range(len(scores)), key=lambda b: (-scores[b], b))
    expected, used = [], 0
    for b in ranked:
        if k is not None and len(expected) == k:
            break
        if budget is None or used + tokens[b] <= budget:
            expected.append(b)
            used += tokens[b]
    assert got == expected


# --- against rank_bm25 on real data, and the index a store keeps ---------------------------

def banking77(n: int):
    from milo_infer.tasks.datasets import DatasetUnavailable, load_dataset

    try:
        train, test, _ = load_dataset("banking77")
    except DatasetUnavailable as exc:
        pytest.skip(f"shared data unavailable (ranking equality needs real text): {exc}")
    return [d.input for d in train[:n]], [d.input for d in test[:200]]


@pytest.mark.slow
def test_top_k_blocks_equal_rank_bm25s_on_banking77():
    """200 real queries over 4,096 real demonstrations in 128 blocks of 32 (assigned out of order):
    per-demonstration scores are BM25Okapi's exactly, so are the top-6 blocks, ties included."""
    texts, queries = banking77(4096)
    block = np.random.default_rng(0).permutation(np.arange(len(texts)) // 32)
    tokens = np.full(128, 800)
    oracle = BM25Okapi([tokenize(t) for t in texts])
    for aggregate in ("max", "sum-top-n"):
        r = BM25BlockRetriever(texts, block, tokens, aggregate=aggregate, top_n=3)
        for q in queries:
            per_example = oracle.get_scores(tokenize(q))
            by_block = [np.sort(per_example[block == b])[::-1] for b in range(128)]
            expected = [s[0] if aggregate == "max" else s[:3].sum() for s in by_block]
            assert r.select(q, k=6) == select_blocks(np.array(expected), tokens, k=6), q
            if aggregate == "max":
                np.testing.assert_array_equal(r.scores(q), expected)


@pytest.mark.slow
def test_segmented_index_retrieves_format_3s_blocks_on_banking77():
    """Format 4's index (vocabulary and idf corpus-wide, postings in 16 segments, combined per query through
    its term table) gives a format-3 index's scores to the bit over 4,096 real demonstrations, so the same
    blocks in the same order for 200 real queries."""
    from milo_store import text_index
    from milo_store.text_index import TextIndex, build_text_index

    texts, queries = banking77(4096)
    starts = np.arange(0, 4097, 32)
    tokens = np.full(128, 800)
    whole = BM25BlockRetriever.from_index(TextIndex(build_text_index(texts, np.arange(4096) // 32, 128)), starts, tokens)
    vocabulary, attrs = text_index.vocabulary(texts)
    postings = [text_index.segment_postings(texts[a:a + 256]) for a in range(0, 4096, 256)]
    segmented = BM25BlockRetriever.from_index(
        text_index.SegmentedTextIndex(vocabulary, attrs, postings, starts), starts, tokens)
    for q in queries:
        np.testing.assert_array_equal(segmented.example_scores(q), whole.example_scores(q))
        assert segmented.select(q, k=6) == whole.select(q, k=6), q


def synthetic_store(path):
    from milo_store import CompressionConfig, Layout
    from milo_store.synthetic import build_synthetic_store

    return build_synthetic_store(path, Layout(2, 1, 8), TOKENS, CompressionConfig(ratio=0.5), texts=TEXTS,
                                 example_block=BLOCK)


QUERIES = ["I lost my card", "pending transfer", "card top up transfer exchange", "zzz", "rate rate"]


def test_stored_index_answers_as_an_index_built_from_the_text(tmp_path):
    from milo_store import MiloStore

    path = synthetic_store(tmp_path / "s")
    fresh = retriever()
    with MiloStore.open(path, tier="disk") as store:
        stored = store_retriever(store)
        assert isinstance(stored.index.idf, np.memmap)  # the vocabulary is mapped, not read, and so are postings:
        docs = stored.index.segments[0][3]
        while isinstance(docs, np.ndarray):
            docs = docs.base
        assert isinstance(docs.obj, mmap.mmap)  # a view of the chunk file mapped
        for q in QUERIES:
            np.testing.assert_array_equal(stored.scores(q), fresh.scores(q))
            assert stored.select(q, k=3) == fresh.select(q, k=3)


def test_a_store_without_an_index_is_indexed_at_mount_and_answers_the_same(tmp_path):
    import shutil

    from milo_store import MiloStore

    path = synthetic_store(tmp_path / "s")
    with MiloStore.open(path, tier="disk") as store:
        before = [store_retriever(store, aggregate="sum-top-n").scores(q) for q in QUERIES]
    shutil.rmtree(path / "indexes")  # what a store written before the index looks like
    with MiloStore.open(path, tier="disk") as store:
        with pytest.warns(UserWarning, match="no BM25 index: indexing its 8 demonstrations at mount"):
            r = store_retriever(store, aggregate="sum-top-n")
        for q, s in zip(QUERIES, before):
            np.testing.assert_array_equal(r.scores(q), s)


def test_a_corrupted_index_is_refused_at_mount(tmp_path):
    from milo_store import MiloStore, StoreCorruptedError

    from milo_store.synthetic import flipped_copy

    path = flipped_copy(synthetic_store(tmp_path / "s"), "segment-0/posting_docs", tmp_path / "damaged")
    with MiloStore.open(path, tier="disk") as store:
        with pytest.raises(StoreCorruptedError, match="text segment 0 .* posting_docs fails its checksum"):
            store_retriever(store)


def test_an_index_that_disagrees_with_its_store_is_refused(tmp_path):
    import shutil

    from milo_store import CompressionConfig, Layout, MiloStore, StoreCorruptedError
    from milo_store.synthetic import build_synthetic_store

    path = synthetic_store(tmp_path / "s")
    other = build_synthetic_store(tmp_path / "o", Layout(2, 1, 8), TOKENS, CompressionConfig(ratio=0.5),
                                  texts=TEXTS[:6], example_block=BLOCK[:6])
    shutil.rmtree(path / "indexes")
    shutil.copytree(other / "indexes", path / "indexes")  # sound bytes, another store's demonstrations
    with MiloStore.open(path, tier="disk") as store:
        with pytest.raises(StoreCorruptedError, match="segments hold 8 demonstrations, the vocabulary counts 6"):
            store_retriever(store)


def test_matches_says_whether_any_query_term_is_in_a_demonstration():
    r = retriever()
    assert r.matches(TEXTS[0].split()[0].upper() + " zyxw")  # case folded, one known term is enough
    assert not r.matches("zyxw qqvv") and not r.matches("") and not r.matches("?!")
    assert not r.scores("zyxw qqvv").any()  # what a query without a match gets: every block 0
