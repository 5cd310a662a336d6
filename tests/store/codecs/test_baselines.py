"""The paper's baselines in the store format: global-proj (one corpus projection per layer, K/V, head)
and example-svd (one SVD per demonstration, store blocks finer than retrieval groups), with its
activation-aware variant example-asvd (the SVD of X diag(s), B stored divided by s)."""
import numpy as np
import pytest
import torch

from milo_store import CompressionConfig, Layout, MiloStore, Staging, factorize_block, write_store
from milo_store.layers import LayerSpec
from milo_store.codecs.baselines import SCALE_FLOOR, ExampleSplit, GlobalProjection, WeightedBlocks, weights
from milo_store.codecs.planning import StagedBlocks
from milo_store.codecs.lowrank_reference import unpack_block, reconstruct
from milo_store.synthetic import staged_synthetic_blocks
from milo_store.writer import StoreWriter

LAYOUT = Layout(2, 2, 16)
# demonstrations' token counts per staged block (a retrieval group)
GROUPS = [[7, 5, 9], [6, 8], [4, 7, 3, 5]]


def stage(tmp_path, tokens, seed=0):
    """SVD staging of synthetic blocks and their exact K/V [L, 2, H, T, d]."""
    return staged_synthetic_blocks(tmp_path / "staging", LAYOUT, tokens, seed)


def examples_of(groups):
    n = sum(map(len, groups))
    return {"input": [f"demo {e}" for e in range(n)], "output": ["x"] * n, "id": [str(e) for e in range(n)],
            "block": [g for g, members in enumerate(groups) for _ in members],
            "tokens": [t for members in groups for t in members]}


def stored_dense(store: MiloStore, i: int) -> torch.Tensor:
    """Block i of a store rebuilt as X [L, 2, H, T, d]."""
    T, L, H, d = int(store.block_tokens[i]), LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    x = torch.zeros(L, 2, H, T, d)
    for idx, A, S, B in unpack_block(store.block(i).float(), store.layout, store.ranks[i], T):
        x[idx] = reconstruct(A, S, B)
    return x


def test_global_projection_is_exact_at_full_rank(tmp_path):
    staging, xs = stage(tmp_path, [20, 9, 33])  # 9 < d: still exact, the rank is d
    config = CompressionConfig(codec="global-proj", full_rank=True, ratio=1.0, dtype="float32")
    path = write_store(tmp_path / "s", staging, 3, LAYOUT, config)
    with MiloStore.open(path) as store:
        assert (store.ranks == LAYOUT.head_dim).all() and not store.grouped
        for i, x in enumerate(xs):
            torch.testing.assert_close(stored_dense(store, i), x, atol=1e-4, rtol=1e-4)
        P = GlobalProjection(staging, 3).P
        torch.testing.assert_close(P.transpose(-1, -2) @ P, torch.eye(LAYOUT.head_dim).expand_as(P), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_global_projection_never_beats_per_block_svd(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    staging = Staging(tmp_path / "staging", {"random": seed})
    xs = [torch.randn(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, t, LAYOUT.head_dim, generator=g) for t in (30, 12, 25)]
    for i, x in enumerate(xs):
        staging.put(i, factorize_block(x[:, 0], x[:, 1]))
    source = GlobalProjection(staging, len(xs))
    for i, x in enumerate(xs):
        f, svd = source.factors(i), staging.get(i)
        for r in range(1, LAYOUT.head_dim):
            projected = (f.A[..., :r] * f.S[..., None, :r]) @ f.B[..., :r].transpose(-1, -2)
            kept = min(r, svd.S.shape[-1])
            truncated = (svd.A[..., :kept] * svd.S[..., None, :kept]) @ svd.B[..., :kept].transpose(-1, -2)
            err_global = (x - projected).flatten(-2).norm(dim=-1)
            err_block = (x - truncated).flatten(-2).norm(dim=-1)
            assert (err_global >= err_block - 1e-4 * x.flatten(-2).norm(dim=-1)).all()  # Eckart–Young


def test_global_projection_ranks_are_uniform_per_head_and_bytes_meet_the_ratio(tmp_path):
    staging, _ = stage(tmp_path, [40, 33, 48, 40])
    path = write_store(tmp_path / "s", staging, 4, LAYOUT, CompressionConfig(codec="global-proj", ratio=0.5))
    with MiloStore.open(path) as store:
        spread = store.ranks.max(axis=0).astype(int) - store.ranks.min(axis=0)
        assert (spread <= 1).all()  # one shared projection: blocks of a (layer, kind, head) rise together
        acc = store.accounting()
        assert 0.45 < acc["ratio"] <= 0.5 and store.meta["codec"] == "global-proj"


def test_example_svd_store_maps_groups_back_to_their_demonstrations(tmp_path):
    staging, xs = stage(tmp_path, [sum(m) for m in GROUPS])
    examples = examples_of(GROUPS)
    config = CompressionConfig(codec="example-svd", full_rank=True, ratio=1.0, dtype="float32")
    path = write_store(tmp_path / "s", staging, len(GROUPS), LAYOUT, config, examples=examples)
    with MiloStore.open(path, tier="disk") as store:
        assert store.grouped and store.num_groups == len(GROUPS) and store.num_blocks == len(examples["id"])
        stored = store.examples()
        assert stored["id"] == examples["id"]
        # each demonstration is its own store block, inside the group its block was
        assert stored["block"] == list(range(len(examples["id"])))
        assert store.block_group.tolist() == examples["block"]
        assert store.block_tokens.tolist() == examples["tokens"]
        assert store.group_tokens().tolist() == [sum(m) for m in GROUPS]
        for g, x in enumerate(xs):
            blocks = store.blocks_of([g])
            assert [stored["id"][b] for b in blocks] == [i for i, grp in zip(examples["id"], examples["block"]) if grp == g]
            rebuilt = torch.cat([stored_dense(store, b) for b in blocks], dim=-2)  # the group's context rows
            torch.testing.assert_close(rebuilt, x, atol=1e-4, rtol=1e-4)
        assert store.blocks_of([2, 0]) == [5, 6, 7, 8, 0, 1, 2]


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_example_svd_bytes_include_the_finer_index_and_meet_the_ratio(tmp_path, ratio):
    groups = [[25] * 6, [23, 27, 25, 26, 24, 25]]
    staging, _ = stage(tmp_path, [sum(m) for m in groups])
    path = write_store(tmp_path / "s", staging, 2, LAYOUT, CompressionConfig(codec="example-svd", ratio=ratio),
                       examples=examples_of(groups))
    with MiloStore.open(path) as store:
        acc = store.accounting()
        per_block = LAYOUT.units_per_block * 2 + 4 + 4 + 4  # ranks, tokens, checksum, group
        assert acc["index_bytes"] == store.num_blocks * per_block
        factors = int(LAYOUT.segment_sizes(store.ranks, store.block_tokens).sum()) * 2
        assert acc["total_bytes"] == factors + acc["index_bytes"]
        assert ratio - 0.05 < acc["ratio"] <= ratio


def test_example_svd_needs_token_counts_that_match_the_staging(tmp_path):
    staging, _ = stage(tmp_path, [sum(m) for m in GROUPS])
    config = CompressionConfig(codec="example-svd", ratio=0.5)
    examples = examples_of(GROUPS)
    with pytest.raises(ValueError, match="token counts"):
        write_store(tmp_path / "s", staging, 3, LAYOUT, config, examples={k: v for k, v in examples.items() if k != "tokens"})
    examples["tokens"][0] += 1
    with pytest.raises(ValueError, match="holds 21 tokens"):
        write_store(tmp_path / "s", staging, 3, LAYOUT, config, examples=examples)


def test_example_split_spectra_match_its_factors(tmp_path):
    staging, _ = stage(tmp_path, [sum(m) for m in GROUPS])
    ex = examples_of(GROUPS)
    source = ExampleSplit(staging, ex["block"], ex["tokens"], len(GROUPS))
    for j in range(source.num_blocks):
        tokens, s = source.spectrum(j)
        f = source.factors(j)
        assert tokens == f.tokens == ex["tokens"][j]
        torch.testing.assert_close(s, f.S, atol=1e-4, rtol=1e-4)


def test_block_group_must_be_contiguous_groups_in_order(tmp_path):
    ranks, tokens = np.ones((3, 2, 2, 2)), np.array([4, 4, 4])
    for bad in ([0, 2, 2], [1, 1, 1], [0, 1, 0], [0, 1]):
        with pytest.raises(ValueError, match="block_group"):
            StoreWriter(tmp_path / "s", LAYOUT, ranks, tokens, block_group=np.array(bad))


def test_stores_without_block_group_have_one_group_per_block(small_store):
    with MiloStore.open(small_store) as store:
        assert not store.grouped and store.num_groups == store.num_blocks
        assert store.blocks_of([2, 0]) == [2, 0]
        assert store.group_tokens().tolist() == store.block_tokens.tolist()


# --- example-asvd: example-svd on X diag(s), B divided by s after ----------------------------------

def scale_of(seed: int, spread: float = 2.0) -> torch.Tensor:
    """Positive channel scales [L, 2, H, d], log-normal: some channels far above others."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(spread * torch.randn(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g))


def test_example_asvd_undoes_its_weighting_at_full_rank(tmp_path):
    staging, xs = stage(tmp_path, [sum(m) for m in GROUPS])
    config = CompressionConfig(codec="example-svd", query_aware=True, full_rank=True, ratio=1.0, dtype="float32")
    scale = scale_of(0, spread=3.0)  # wider than the floor: floored channels must be undone as well
    path = write_store(tmp_path / "s", staging, len(GROUPS), LAYOUT, config, examples=examples_of(GROUPS),
                       channel_scale=scale)
    with MiloStore.open(path) as store:
        assert store.meta["codec"] == "example-svd" and store.meta["allocation"]["query_aware"] and store.grouped
        for g, x in enumerate(xs):
            rebuilt = torch.cat([stored_dense(store, b) for b in store.blocks_of([g])], dim=-2)
            # fp32 rounding of the weighted SVD, magnified up to 1/SCALE_FLOOR in the least-weighted channels
            assert (rebuilt - x).norm() <= 1e-4 * x.norm()
            assert (rebuilt - x).abs().max() <= 1e-7 / SCALE_FLOOR * 10 * x.abs().max()


def test_example_asvd_with_unit_scale_is_example_svd(tmp_path):
    groups = [[25] * 6, [23, 27, 25, 26, 24, 25]]
    staging, _ = stage(tmp_path, [sum(m) for m in groups])
    ones = torch.ones(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    paths = [write_store(tmp_path / str(aware), staging, 2, LAYOUT,
                         CompressionConfig(codec="example-svd", query_aware=aware, ratio=0.4),
                         examples=examples_of(groups), channel_scale=scale)
             for aware, scale in ((False, None), (True, 3 * ones))]  # a common factor is no weighting
    with MiloStore.open(paths[0]) as plain, MiloStore.open(paths[1]) as weighted:
        assert (plain.ranks == weighted.ranks).all() and (plain.ranks < LAYOUT.head_dim).any()
        for i in range(plain.num_blocks):
            assert torch.equal(plain.block(i), weighted.block(i))


@pytest.mark.parametrize("seed", range(3))
def test_example_asvd_minimises_the_weighted_error(tmp_path, seed):
    """Eckart–Young for X diag(s): at every rank, example-asvd's s-weighted error is example-svd's or less."""
    staging, _ = stage(tmp_path, [sum(m) for m in GROUPS], seed=seed)
    ex = examples_of(GROUPS)
    scale = torch.ones(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    scale[..., torch.randperm(LAYOUT.head_dim, generator=torch.Generator().manual_seed(seed))[:4]] = 10.0
    plain = ExampleSplit(staging, ex["block"], ex["tokens"], len(GROUPS))
    weighted = ExampleSplit(staging, ex["block"], ex["tokens"], len(GROUPS), channel_scale=scale)
    gain = 0.0
    for j in range(plain.num_blocks):
        x = plain._rows(j)
        f, fw = plain.factors(j), weighted.factors(j)
        for r in range(1, f.S.shape[-1]):
            def weighted_error(f):
                approx = (f.A[..., :r] * f.S[..., None, :r]) @ f.B[..., :r].transpose(-1, -2)
                return ((x - approx) * scale.unsqueeze(-2)).flatten(-2).norm(dim=-1)
            e_plain, e_weighted = weighted_error(f), weighted_error(fw)
            assert (e_weighted <= e_plain + 1e-4 * (x * scale.unsqueeze(-2)).flatten(-2).norm(dim=-1)).all()
            gain += float((e_plain - e_weighted).sum())
    assert gain > 0  # and the weighting does change the factors


def test_example_asvd_allocates_on_the_weighted_spectrum(tmp_path):
    staging, _ = stage(tmp_path, [sum(m) for m in GROUPS])
    ex = examples_of(GROUPS)
    scale = scale_of(1)
    source = ExampleSplit(staging, ex["block"], ex["tokens"], len(GROUPS), channel_scale=scale)
    plain = ExampleSplit(staging, ex["block"], ex["tokens"], len(GROUPS))
    for j in range(source.num_blocks):
        tokens, s = source.spectrum(j)
        f = source.factors(j)
        assert tokens == f.tokens
        torch.testing.assert_close(s, f.S, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(s, plain.spectrum(j)[1], rtol=1e-2)


def test_example_asvd_needs_a_valid_channel_scale_and_other_codecs_take_none(tmp_path):
    staging, _ = stage(tmp_path, [sum(m) for m in GROUPS])
    examples = examples_of(GROUPS)
    asvd = CompressionConfig(codec="example-svd", query_aware=True, ratio=0.5)
    with pytest.raises(ValueError, match="query-aware store needs a channel scale"):
        write_store(tmp_path / "s", staging, 3, LAYOUT, asvd, examples=examples)
    with pytest.raises(ValueError, match="only for query-aware stores"):
        write_store(tmp_path / "s", staging, 3, LAYOUT, CompressionConfig(codec="example-svd", ratio=0.5),
                    examples=examples, channel_scale=scale_of(0))
    wrong_shape = torch.ones(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim + 2)
    with pytest.raises(ValueError, match="does not match"):
        write_store(tmp_path / "s", staging, 3, LAYOUT, asvd, examples=examples, channel_scale=wrong_shape)
    no_values = scale_of(0)
    no_values[:, 1] = 0
    with pytest.raises(ValueError, match="not all zero"):
        write_store(tmp_path / "s", staging, 3, LAYOUT, asvd, examples=examples, channel_scale=no_values)
    assert not (tmp_path / "s").exists()


def test_example_asvd_weights_are_scaled_per_kind_and_floored():
    raw = scale_of(2, spread=2.5)
    raw[1, 0, 1, 3] = 0.0  # a dead channel is floored, not divided by
    s = weights(raw)
    assert torch.equal(s.amax(dim=(0, 2, 3)), torch.ones(2)) and float(s.min()) == pytest.approx(SCALE_FLOOR)
    top = raw.amax(dim=(0, 2, 3), keepdim=True)
    kept = raw >= SCALE_FLOOR * top
    assert not kept.all()
    torch.testing.assert_close(s[kept], (raw / top)[kept], rtol=0, atol=0)


def test_weights_of_a_kind_the_layout_stores_nowhere_may_be_zero():
    """An MLA layout stores its latent as keys and no values: its value scales are all zero (no o_proj reads
    them), which is legal there and weighs 1; keys it stores still need a scale, and a broken one still errors."""
    latent = Layout.of([LayerSpec(kind="latent", kv_heads=1, head_dim=16, latent=12)] * LAYOUT.num_layers)
    raw = scale_of(4)[:, :, :1]
    raw[:, 1] = 0
    s = weights(raw, latent.present)
    torch.testing.assert_close(s[:, 0], weights(scale_of(4)[:, :, :1])[:, 0], rtol=0, atol=0)
    assert torch.equal(s[:, 1], torch.ones_like(s[:, 1]))
    for broken in (torch.zeros_like(raw), raw.clone().fill_(float("nan")), -raw):
        with pytest.raises(ValueError, match="query-aware: channel scales must be finite"):
            weights(broken, latent.present)
    with pytest.raises(ValueError, match="not all zero for a kind the layout stores"):
        weights(raw, Layout(LAYOUT.num_layers, 1, 16).present)  # keys and values stored: the zero values are broken


# --- query-aware MILO blocks (svd codec): the same weighting at block granularity -------------------

def test_query_aware_svd_undoes_its_weighting_at_full_rank_and_minimises_the_weighted_error(tmp_path):
    tokens = [sum(m) for m in GROUPS]
    staging, xs = stage(tmp_path, tokens)
    scale = scale_of(3)
    path = write_store(tmp_path / "s", staging, len(tokens), LAYOUT,
                       CompressionConfig(query_aware=True, full_rank=True, ratio=1.0, dtype="float32"),
                       channel_scale=scale)
    with MiloStore.open(path) as store:
        for i, x in enumerate(xs):
            assert (stored_dense(store, i) - x).norm() <= 1e-4 * x.norm()
    s = weights(scale)
    plain, weighted = StagedBlocks(staging, len(tokens)), WeightedBlocks(staging, len(tokens), scale)
    for i, x in enumerate(xs):
        n, spectrum = weighted.spectrum(i)
        f, fw = plain.factors(i), weighted.factors(i)
        assert n == tokens[i]
        torch.testing.assert_close(spectrum, fw.S, atol=1e-4, rtol=1e-4)  # allocation sees the weighted spectrum
        r = 3
        def weighted_error(f):
            approx = (f.A[..., :r] * f.S[..., None, :r]) @ f.B[..., :r].transpose(-1, -2)
            return ((x - approx) * s.unsqueeze(-2)).flatten(-2).norm(dim=-1)
        assert (weighted_error(fw) <= weighted_error(f) * (1 + 1e-4)).all()
        assert (weighted_error(fw) < weighted_error(f) * 0.99).any()


def test_query_aware_applies_only_to_svd_and_example_svd():
    for codec in ("identity", "global-proj"):
        with pytest.raises(ValueError, match="query-aware weighting applies"):
            CompressionConfig(codec=codec, query_aware=True)


def test_allocation_record_leaves_later_fields_out_at_their_defaults():
    """Stores written before query_aware (or in_context) existed keep the record (and the keys derived from it)."""
    from dataclasses import asdict
    from milo_store.codecs.planning import allocation_record
    plain = CompressionConfig(ratio=0.25, dtype="int8")
    later = ("query_aware", "in_context")
    assert allocation_record(plain) == {k: v for k, v in asdict(plain).items() if k not in later}
    assert allocation_record(CompressionConfig(query_aware=True))["query_aware"] is True
    in_context = CompressionConfig(codec="bits", query_aware=True, dtype="float16", in_context=True)
    assert allocation_record(in_context)["in_context"] is True
    assert allocation_record({**asdict(plain), "query_aware": False}) == allocation_record(plain)  # a stored record
