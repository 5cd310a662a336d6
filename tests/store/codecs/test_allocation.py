import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from milo_store.codecs.allocation import BudgetError, allocate_ranks
from milo_store.layout import Layout, compressed_bytes, full_kv_bytes, index_bytes

POLICIES = ["entropy", "energy", "uniform", "random"]


def spectra_for(rng, N, L, H, d):
    return np.sort(rng.random((N, L, 2, H, d)) * rng.random((N, L, 2, H, 1)) * 10, axis=-1)[..., ::-1]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 2), st.sampled_from([8, 16]),
       st.floats(0.2, 1.0), st.sampled_from(POLICIES), st.sampled_from(["head", "layer", "global"]),
       st.sampled_from(["separate", "shared"]), st.integers(0, 2**16))
def test_budget_and_bounds_hold(N, L, H, d, ratio, policy, scope, kv_split, seed):
    rng = np.random.default_rng(seed)
    layout = Layout(L, H, d)
    tokens = rng.integers(4, 40, N)
    spectra = spectra_for(rng, N, L, H, d)
    r_max = d // 2 + 1
    # rank r_min = 1 everywhere, index included, against the budget: every group (whatever the scope and
    # split) holds all blocks and the same mix of fp16 units, so each group's need and budget are the
    # store's in one proportion, and the store-wide comparison decides for every group alike
    need = compressed_bytes(layout, np.ones((N, L, 2, H)), tokens)["total_bytes"]
    budget = ratio * full_kv_bytes(layout, tokens)
    try:
        ranks = allocate_ranks(spectra, tokens, layout, ratio, policy=policy, scope=scope, kv_split=kv_split,
                               r_min=1, r_max=r_max, seed=seed)
    except BudgetError:
        assert need > budget * (1 - 1e-9)  # raised exactly when r_min everywhere cannot fit
        return
    assert need <= budget * (1 + 1e-9)
    assert ranks.shape == (N, L, 2, H)
    assert ranks.min() >= 1
    assert (ranks <= np.minimum(tokens, r_max).reshape(-1, 1, 1, 1)).all()
    acc = compressed_bytes(layout, ranks, tokens)
    assert acc["total_bytes"] <= ratio * acc["full_fp16_bytes"] + 1e-6


def brute_force(gains, budget_units, r_min, r_max):
    best = -1.0
    for combo in itertools.product(range(r_min, r_max + 1), repeat=len(gains)):
        if sum(combo) <= budget_units:
            best = max(best, sum(g[:r].sum() for g, r in zip(gains, combo)))
    return best


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(0, 2**16), st.floats(0.15, 0.9))
def test_entropy_greedy_matches_brute_force_optimum(N, seed, ratio):
    """Equal block lengths make every rank unit cost the same: greedy must then be optimal."""
    rng = np.random.default_rng(seed)
    d, T = 6, 10
    layout = Layout(1, 1, d)
    tokens = np.full(N, T)
    spectra = spectra_for(rng, N, 1, 1, d)
    ranks = allocate_ranks(spectra, tokens, layout, ratio, policy="entropy", r_min=0, eps=1e-2)
    eps = 1e-2
    gains = [np.log1p(spectra[i, 0, 0, 0] ** 2 / eps ** 2) for i in range(N)]
    unit_bytes = (T + d + 1) * 2
    budget = ratio * full_kv_bytes(layout, tokens) - index_bytes(layout, N)
    budget_units = int(budget * (T * d * 2) / (T * d * 2 * 2) // unit_bytes)  # the key group's half
    got = sum(g[:r].sum() for g, r in zip(gains, ranks[:, 0, 0, 0]))
    assert ranks[:, 0, 0, 0].sum() <= budget_units
    assert got >= brute_force(gains, budget_units, 0, d) - 1e-9


def test_budget_too_small_is_a_clear_error():
    layout = Layout(1, 1, 64)
    with pytest.raises(BudgetError, match="r_min"):
        allocate_ranks(np.ones((2, 1, 2, 1, 64)), np.array([8, 8]), layout, 0.01, r_min=4)


def test_bad_arguments_are_named():
    layout = Layout(1, 1, 4)
    s = np.ones((1, 1, 2, 1, 4))
    for kwargs, word in (({"policy": "best"}, "policy"), ({"scope": "block"}, "scope"), ({"kv_split": "x"}, "kv_split")):
        with pytest.raises(ValueError, match=word):
            allocate_ranks(s, np.array([8]), layout, 0.5, **kwargs)
    with pytest.raises(ValueError, match="ratio"):
        allocate_ranks(s, np.array([8]), layout, 1.5)


def test_entropy_gives_more_rank_to_slowly_decaying_blocks():
    layout = Layout(1, 1, 16)
    j = np.arange(16)
    fast, slow = np.exp(-1.0 * j), np.exp(-0.05 * j)
    spectra = np.zeros((2, 1, 2, 1, 16))
    spectra[0, 0, :, 0], spectra[1, 0, :, 0] = fast, slow
    ranks = allocate_ranks(spectra, np.array([64, 64]), layout, 0.4, policy="entropy")
    assert ranks[1, 0, 0, 0] > ranks[0, 0, 0, 0]
    uniform = allocate_ranks(spectra, np.array([64, 64]), layout, 0.4, policy="uniform")
    assert abs(int(uniform[1, 0, 0, 0]) - int(uniform[0, 0, 0, 0])) <= 1


def test_key_share_moves_bytes_between_keys_and_values():
    rng = np.random.default_rng(3)
    layout = Layout(2, 2, 16)
    tokens = np.array([40, 50, 30])
    spectra = spectra_for(rng, 3, 2, 2, 16)
    even = allocate_ranks(spectra, tokens, layout, 0.4)
    values_heavy = allocate_ranks(spectra, tokens, layout, 0.4, key_share=0.25)
    assert values_heavy[:, :, 0].sum() < even[:, :, 0].sum() and values_heavy[:, :, 1].sum() > even[:, :, 1].sum()
    acc = compressed_bytes(layout, values_heavy, tokens)
    assert acc["total_bytes"] <= 0.4 * acc["full_fp16_bytes"]
    with pytest.raises(ValueError, match="key_share"):
        allocate_ranks(spectra, tokens, layout, 0.4, key_share=1.0)
    with pytest.raises(ValueError, match="separate"):
        allocate_ranks(spectra, tokens, layout, 0.4, key_share=0.3, kv_split="shared")
