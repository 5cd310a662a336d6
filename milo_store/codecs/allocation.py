"""Rank allocation under a byte budget (paper §4.3), with the scopes and policies the evaluation compares.

Every (block, layer, kind, head) matrix is a *unit*; giving it one more rank costs T + d + 1 values
(with quantized factors, the bytes of ``Layout.unit_size``; an INT4/INT2 value unit also pays its
per-token scales, ``Layout.fixed_size``, with its first rank step).
Within an allocation *pool* (the units one budget is shared among, chosen by ``scope`` and ``kv_split``) every unit starts at r_min, and
further rank increments are taken in order of a key until the pool's budget is spent:

- ``entropy``: the paper's marginal gain log(1 + σ²/ε²) per rank unit. It is monotone in σ, so the
  order (and the allocation) does not depend on ε: it hands increments out by singular value;
- ``energy``: σ² per value of cost, which minimises the summed squared (Eckart–Young) error per byte
  when blocks differ in length;
- ``uniform``: lowest rank first, so all units of a pool rise together;
- ``random``: a seeded random order (ablation);
- ``frontier``: per unit, its low-rank ladder *or its raw form* (the K or V itself, quantized like
  the factors: ``Layout.raw_size``), by measured squared error removed per byte. A rank step removes
  σ² less what quantizing its direction loses (``loss``, measured per direction); the raw form has
  its own measured error (``raw_error``). A ladder ends before its first step that removes nothing,
  and its keys are made non-increasing (each capped by the ones before). The raw form joins as one
  step from the rung j* where it meets the lower convex hull of the unit's (bytes, error) points,
  taken only if it removes error; rungs from j* up are dropped, so a raw unit never takes more
  bytes. So a unit with a flat spectrum goes raw, a low-rank one stays factored, and the greedy
  below is unchanged.

Every policy's keys never increase along a unit's ladder, so a sort by key takes each unit's
increments in order (and its first step, with its scales, first).
A pool's budget is ratio × its fp16 full-KV bytes, less its share of the index bytes, so that the
whole compressed set, index included, lands at the target ratio.
"""
import numpy as np

from ..layout import RAW_RANK, Layout, full_kv_bytes, index_bytes

POLICIES = ("entropy", "energy", "uniform", "random", "frontier")
SCOPES = ("head", "layer", "global")  # per (layer, head[, kind]); per layer[, kind]; whole store[, per kind]
KV_SPLITS = ("separate", "shared")


class BudgetError(ValueError):
    """The requested ratio cannot hold even the minimum rank everywhere."""


def allocate_ranks(spectra: np.ndarray, tokens: np.ndarray, layout: Layout, ratio: float, *,
                   policy: str = "entropy", scope: str = "head", kv_split: str = "separate",
                   r_min: int = 1, r_max: int | None = None, eps: float = 1e-3, seed: int = 0,
                   bytes_per_value: int = 2, key_share: float = 0.5, loss: np.ndarray | None = None,
                   raw_error: np.ndarray | None = None) -> np.ndarray:
    """Ranks int16 [N, L, 2, H] from singular values ``spectra`` [N, L, 2, H, n] (descending, zero-padded).

    With ``kv_split="separate"``, keys get ``key_share`` of the budget and values the rest (0.5: each
    its own fp16 share). Pre-RoPE keys are far more low-rank than values, so moving bytes to values
    can buy accuracy at the same total.

    Policy ``frontier`` also takes ``loss`` [N, L, 2, H, n] (the share of each direction's σ² that
    quantizing its factors loses) and ``raw_error`` [N, L, 2, H] (the squared error of each unit's
    raw form, on σ²'s scale); its units may come back as ``RAW_RANK``.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1]; got {ratio}")
    for name, value, allowed in (("policy", policy, POLICIES), ("scope", scope, SCOPES), ("kv_split", kv_split, KV_SPLITS)):
        if value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")
    if not 0 < key_share < 1:
        raise ValueError(f"key_share must be in (0, 1); got {key_share}")
    if key_share != 0.5 and kv_split != "separate":
        raise ValueError("key_share applies only with kv_split='separate'")
    if (policy == "frontier") != (loss is not None and raw_error is not None):
        raise ValueError("the frontier policy, and only it, takes the measured loss and raw_error")
    spectra = np.asarray(spectra, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    N, L, K, H, n = spectra.shape
    if policy == "frontier":
        loss, raw_error = np.asarray(loss, dtype=np.float64), np.asarray(raw_error, dtype=np.float64)
        if loss.shape != spectra.shape or raw_error.shape != spectra.shape[:4]:
            raise ValueError(f"loss {loss.shape} and raw_error {raw_error.shape} must match spectra {spectra.shape}")
    if (L, K, H) != (layout.num_layers, 2, layout.num_kv_heads) or len(tokens) != N:
        raise ValueError(f"spectra shape {spectra.shape} does not match layout {layout} and {len(tokens)} blocks")
    # per unit [N, L, 2, H]: its largest rank, 0 where its layer stores no such unit (`Layout.present`)
    width = np.broadcast_to(layout.widths, layout.present.shape)
    cap = np.minimum(np.minimum(tokens.reshape(N, 1, 1, 1), width), n if r_max is None else min(r_max, n)) * layout.present
    if layout.present.any() and r_min > cap[:, layout.present].min(initial=r_min):
        raise ValueError(f"r_min={r_min} exceeds the largest possible rank {int(cap[:, layout.present].min())} of "
                         "some block")
    floor = np.where(layout.present, r_min, 0) + np.zeros_like(cap)  # every stored unit starts at r_min
    t, kind = tokens.reshape(N, 1, 1, 1), np.arange(2).reshape(2, 1)  # per block and kind -> [N, L, 2, H]
    cost = np.broadcast_to(layout.unit_size(t, kind), (N, L, K, H)).astype(np.float64)
    fixed = np.broadcast_to(layout.fixed_size(t, kind), (N, L, K, H))
    raw_cost = np.broadcast_to(layout.raw_size(t, kind), (N, L, K, H)).astype(np.float64)

    full = full_kv_bytes(layout, tokens, 2)
    spendable = ratio * full - index_bytes(layout, N)  # bytes the factors may take, store-wide
    unit_full = layout.unit_bytes(tokens, 2)  # each unit's fp16 bytes: its share of the budget
    ranks = floor.astype(np.int64)
    keep = [1, 3] if scope == "head" else [1] if scope == "layer" else []
    if kv_split == "separate":
        keep = sorted(keep + [2])
    pool_shape = [spectra.shape[a] for a in keep]
    rng = np.random.default_rng(seed)
    for g in np.ndindex(*pool_shape):
        sel = [slice(None)] * 4
        for axis, i in zip(keep, g):
            sel[axis] = slice(i, i + 1)
        sel = tuple(sel)
        sub = spectra[sel]  # [N', L', K', H', n] with pool axes of size 1
        budget_values = spendable * int(unit_full[sel].sum()) / full / bytes_per_value if full else 0.0
        if kv_split == "separate":
            kind = g[keep.index(2)]
            budget_values *= 2 * (key_share if kind == 0 else 1 - key_share)
        names = {1: "layer {}", 2: ("keys", "values"), 3: "head {}"}
        where = ", ".join(names[a][i] if a == 2 else names[a].format(i) for a, i in zip(keep, g)) or "the store"
        try:
            raw = None if policy != "frontier" else (loss[sel], raw_cost[sel], raw_error[sel])
            ranks[sel] = _allocate_pool(sub, cost[sel], fixed[sel] / bytes_per_value, cap[sel], budget_values,
                                         policy, floor[sel], eps, rng, raw)
        except BudgetError as e:
            unit = "bytes" if layout.quantized else "values"
            raise BudgetError(f"ratio {ratio}: the budget of {where} holds {e.args[0]:.0f} {unit} but rank {r_min} "
                              f"everywhere needs {e.args[1]:.0f}{e.args[2]}; raise the ratio or lower r_min") from None
    return ranks.astype(np.int16)


def _allocate_pool(spectra, cost, first, cap, budget_values, policy, floor, eps, rng, raw=None) -> np.ndarray:
    """Greedy fill of one pool: ranks shaped like cost, spending at most ``budget_values``.

    A unit's rank step costs ``cost``, and its first step ``first`` more (per-token scales); it starts at
    ``floor`` (r_min; 0 for a unit its layer does not store, whose ``cap`` is 0 too). ``raw`` (frontier only):
    (loss, raw cost, raw error) of each unit. Raises BudgetError(budget, need, note) when the floors do not fit.
    """
    shape = cost.shape
    s, cost, first, cap = spectra.reshape(-1, spectra.shape[-1]), cost.reshape(-1), first.reshape(-1), cap.reshape(-1)
    floor = floor.reshape(-1)
    need = (floor * cost).sum() + first[floor > 0].sum()
    left = budget_values - need
    if left < 0:
        scales = first[floor > 0].sum()
        note = f", {scales:.0f} of them per-token value scales" if scales else ""
        raise BudgetError(budget_values, need, note)
    if policy == "frontier":  # the error each step removes; a ladder ends before a step that removes nothing
        loss, raw_cost, raw_error = raw
        gain = s ** 2 * (1 - loss.reshape(len(cost), -1))
        ends = (gain <= 0) | (np.arange(s.shape[1])[None, :] >= cap[:, None])
        cap = np.where(ends.any(1), ends.argmax(1), s.shape[1])
    units, steps = np.nonzero(np.arange(s.shape[1])[None, :] < cap[:, None])  # candidate increments
    mask = steps >= floor[units]
    units, steps = units[mask], steps[mask]
    step_cost = cost[units] + first[units] * (steps == 0)
    sigma2 = s[units, steps] ** 2
    if policy == "entropy":
        key = np.log1p(sigma2 / eps ** 2)
    elif policy == "energy":  # per step's own cost, less a first step's scales: keeps each unit's keys falling
        key = sigma2 / cost[units]
    elif policy == "frontier":  # as energy, less quantization; capped by the unit's earlier keys
        key = np.minimum.accumulate(gain / cost[:, None], axis=1)[units, steps]
    elif policy == "uniform":
        key = -steps.astype(np.float64)
    else:
        key = rng.random(len(units))
    if policy in ("entropy", "energy"):  # spending bytes on an exactly-zero direction buys nothing
        live = sigma2 > 0
        units, steps, key, step_cost = units[live], steps[live], key[live], step_cost[live]
    to_raw = np.zeros(len(units), dtype=bool)
    if policy == "frontier":
        units, steps, key, step_cost, to_raw = _with_raw_steps(gain, (s ** 2).sum(1), cost, first, cap, floor,
                                                               raw_cost.reshape(-1), raw_error.reshape(-1), units,
                                                               steps, key, step_cost)
    order = np.lexsort((to_raw, steps, units, -key))
    units, steps, step_cost, to_raw = units[order], steps[order], step_cost[order], to_raw[order]
    spent = np.cumsum(step_cost)
    take = int(np.searchsorted(spent, left, side="right"))
    ranks = floor.astype(np.int64)
    np.add.at(ranks, units[:take][~to_raw[:take]], 1)
    raw_units = units[:take][to_raw[:take]]
    # The prefix stops at the first increment that does not fit; cheaper units' next steps may still fit.
    left -= spent[take - 1] if take else 0.0
    rest = np.arange(take, len(units))
    for i in rest[steps[take:] == ranks[units[take:]]]:  # at most one next step per unit
        if step_cost[i] <= left:
            if to_raw[i]:
                raw_units = np.append(raw_units, units[i])
            else:
                ranks[units[i]] += 1
            left -= step_cost[i]
    ranks[raw_units] = RAW_RANK
    return ranks.reshape(shape)


def _with_raw_steps(gain, energy, cost, first, cap, floor, raw_cost, raw_error, units, steps, key, step_cost):
    """The frontier's candidate steps: each unit's ladder up to its tangent rank j*, then one step to raw.

    E_r (squared error at rank r) = ``energy`` (Σ σ², the raw error's scale) minus what the first r
    steps remove (``gain``); C_r its cost.
    The raw form (C, E) joins the hull from the rung j* (reachable: r_min <= j* <= cap, C_j* < C) that
    minimises (E_j - E) / (C - C_j): every rung lies above the line from raw through rung j*. Units
    whose raw form removes nothing beyond some cheaper rung keep their whole ladder.
    """
    n = gain.shape[1]
    rank = np.arange(n + 1)
    error = energy[:, None] - np.concatenate((np.zeros((len(gain), 1)), np.cumsum(gain, 1)), 1)
    spent = rank * cost[:, None] + (rank > 0) * first[:, None]
    rung = (rank >= floor[:, None]) & (rank <= cap[:, None]) & (spent < raw_cost[:, None])
    rate = np.where(rung, (error - raw_error[:, None]) / np.maximum(raw_cost[:, None] - spent, 1e-300), np.inf)
    j = rate.argmin(1)
    best = rate[np.arange(len(gain)), j]
    goes_raw = np.isfinite(best) & (best > 0)
    keep = ~goes_raw[units] | (steps < j[units])
    raw_u = np.nonzero(goes_raw)[0]
    # The sort must take a unit's rungs before its raw step (the raw step's cost assumes rank j*): where
    # measured losses bend the ladder, a rung may be worth less than the hull's raw rate; cap it there.
    np.minimum.at(best, units[keep], key[keep])
    return (np.concatenate((units[keep], raw_u)), np.concatenate((steps[keep], j[raw_u])),
            np.concatenate((key[keep], best[raw_u])),
            np.concatenate((step_cost[keep], raw_cost[raw_u] - spent[raw_u, j[raw_u]])),
            np.concatenate((np.zeros(keep.sum(), dtype=bool), np.ones(len(raw_u), dtype=bool))))
