"""The rate–distortion study of issue 45: the error the model sees against real bytes, codec by codec.

On the staged (full-rank) blocks of a store's build, every codec below is run at each ratio ρ (its
bytes over the fp16 full K/V) and its blocks are decoded back to pre-RoPE K/V. The error is measured
where the model sees it: each layer's attention output over one held-out block, for real queries'
pre-RoPE queries (test items after the store's anchor, `capture_queries`), keys rotated at the block's
positions and the queries at the positions that follow (`attention_error`). Bytes are counted as
written: packed segments, per-column scales, bases, means and the per-block index.

Codecs (`CODECS`):

- ``today``: `milo build`'s default at ρ (low-rank + INT4 factors, query-aware; the writer's own
  `plan_ranks` and `pack_block`, read back by the kernels' CPU path);
- ``today+mean`` (a): the same on each block's mean-removed K/V, the means kept in fp16 and paid for;
- ``today+bits`` (b): each block's query-weighted SVD with one width per component (0 to 8 bits for
  its coefficients, INT8 for its basis column), chosen store-wide by measured error (`allocate_bits`),
  keys and values each on half the budget; ``today+bits+attn``: its value widths chosen as
  ``transform+attn``'s are;
- ``today+zstd`` (c): today's packed blocks through Zstandard, its budget raised until the coded bytes
  meet ρ;
- ``transform``: per (layer, kind, head) a mean and a PCA basis of the query-weighted rows fitted once
  on the fit blocks (stored once, fp16, counted); each block's rows projected, each component's
  coefficients at one width for the whole store (fixed-width packed), chosen by measured error;
- ``transform-shared``: the same with one budget for keys and values (``transform`` gives each half);
- ``transform+attn``: ``transform`` whose value widths are chosen by the error the attention output takes,
  measured with calibration queries (demonstrations the store does not hold) on the fit blocks;
- ``transform+zstd``: the same with its packed coefficients through Zstandard, budget retargeted.

Blocks are split in two: even-numbered blocks fit the transform and its widths, odd-numbered ones are
measured (held out), for every codec alike.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from milo_kernels import reconstruct_layer
from milo_kernels.naive import apply_rope
from milo_store import Staging
from milo_store.codecs.baselines import dense, weights
from milo_store.codecs.lowrank import BlockFactors, pack_block
from milo_store.codecs.planning import pass_two_source, plan_ranks, quant_layout
from milo_store.layout import Layout, full_kv_bytes, index_bytes
from milo_store.codecs.rate_distortion import (WIDTHS, allocate_bits, attended_column_errors, column_bytes, column_errors, fit_transform,
                                        pack_columns, quantize_columns, dequantize_columns, roundtrip_columns,
                                        zstd_bytes)
from milo_store.staging import FINGERPRINT

from ..building.builder import CALIBRATION_TOKENS
from ..building.config import default_compression
from ..models import attention_modules, attention_of, capture_queries, channel_scales, layer_rope_tables

CODECS = ("today", "today+mean", "today+bits", "today+bits+attn", "today+zstd", "transform", "transform-shared",
          "transform+attn", "transform+zstd")


@dataclass
class StudyInput:
    """What every codec is run on and measured against."""
    blocks: list[torch.Tensor]  # staged blocks' K/V [L, 2, H, T, d], fp32, pre-RoPE
    staging: Staging
    layout: Layout  # floating (unquantized) layout of the store
    channel_scale: torch.Tensor  # raw query-aware statistics [L, 2, H, d] (what a build computes)
    queries: torch.Tensor  # pre-RoPE queries [L, Nq, Hq, d]
    query_positions: torch.Tensor  # [Nq]: each query token's position after the block's last token
    calibration: torch.Tensor  # pre-RoPE queries of demonstrations not in the store, as queries: [L, Nc, Hq, d]
    calibration_positions: torch.Tensor  # [Nc]
    rope: object  # RopeTables over every position needed
    scaling: float  # the attention's score scale
    rope_layout: dict  # the kernels' RoPE layout arguments (`Attention.rope_layout`)

    @property
    def fit(self) -> list[int]:
        return list(range(0, len(self.blocks), 2))

    @property
    def held_out(self) -> list[int]:
        return list(range(1, len(self.blocks), 2))

    @property
    def weight(self) -> torch.Tensor:
        return weights(self.channel_scale, self.layout.present)

    @property
    def tokens(self) -> np.ndarray:
        return np.array([b.shape[-2] for b in self.blocks], dtype=np.int64)

    @property
    def full_bytes(self) -> int:
        return full_kv_bytes(self.layout, self.tokens)


def open_staging(directory) -> Staging:
    """A kept staging directory (`build_store(keep_staging=True)`), opened without changing it."""
    directory = Path(directory)
    fingerprint = directory / FINGERPRINT
    if not fingerprint.is_file():
        raise FileNotFoundError(f"{directory} holds no staged build (no {FINGERPRINT})")
    return Staging(directory, json.loads(fingerprint.read_text()), join=True)


def prepare(loaded, store, staging: Staging, test, task, num_queries: int, calibration=()) -> StudyInput:
    """Read the staged blocks, compute the build's channel scales and capture the test queries' pre-RoPE
    queries, each test item after the store's anchor (as the engine places a query after its prefix), and
    those of ``calibration`` items (demonstrations the store does not hold: what an attention-aware
    allocation may measure with at build time)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    blocks = [dense(staging.get(i)).float() for i in staging.staged()]
    anchor = list(store.meta["build"]["anchor_token_ids"])
    corpus = [int(t) for i in range(store.num_blocks) for t in store.token_ids(i)]
    sample = (anchor + corpus)[:CALIBRATION_TOKENS]
    scale = channel_scales(model, sample)

    def captured(items):
        queries, positions = [], []
        for item in items:
            ids = tokenizer(task.render_query(item.input), add_special_tokens=False)["input_ids"]
            queries.append(capture_queries(model, anchor + ids)[:, len(anchor):])
            positions.append(torch.arange(len(ids)))
        return queries, positions

    queries, positions = captured(test[:num_queries])
    calibration_queries, calibration_positions = captured(calibration)
    longest = max(b.shape[-2] for b in blocks) + max(len(p) for p in positions + calibration_positions)
    layout = replace(store.layout, quant=None)
    return StudyInput(blocks=blocks, staging=staging, layout=layout, channel_scale=scale,
                      queries=torch.cat(queries, dim=1), query_positions=torch.cat(positions),
                      calibration=torch.cat(calibration_queries, dim=1) if calibration_queries else queries[0][:, :0],
                      calibration_positions=torch.cat(calibration_positions) if calibration_positions else
                      torch.zeros(0, dtype=torch.int64),
                      rope=layer_rope_tables(model, longest), scaling=float(attention_modules(model)[0].scaling),
                      rope_layout=attention_of(model.config).rope_layout(model.config))


def attention_probs(data: StudyInput, x: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor
                    ) -> torch.Tensor:
    """Attention of ``queries`` [L, M, Hq, d] (at ``positions`` after the block) over block x's exact keys,
    softmax over the block: [L, H, M * n_rep, T], query heads grouped by the KV head they read."""
    L, _, H, T, d = x.shape
    out = []
    for layer in range(L):
        cos, sin = data.rope.layer(layer)
        q = apply_rope(queries[layer].transpose(0, 1), cos[T + positions], sin[T + positions], **data.rope_layout)
        q = q.reshape(H, -1, d)
        k = apply_rope(x[layer, 0].float(), cos[:T], sin[:T], **data.rope_layout)
        out.append(torch.softmax(q @ k.transpose(-1, -2) * data.scaling, dim=-1))
    return torch.stack(out)


def attention_error(data: StudyInput, exact: torch.Tensor, decoded: torch.Tensor) -> dict:
    """Squared errors of one block's decoded K/V [L, 2, H, T, d]: the attention output's (over the study's
    queries, softmax over the block) and its reference energy, and the weighted K and V errors."""
    L, _, H, T, d = exact.shape
    q_all = data.queries
    n_rep = q_all.shape[2] // H
    out = {"attention": 0.0, "attention_ref": 0.0, "keys": 0.0, "keys_ref": 0.0, "values": 0.0, "values_ref": 0.0}
    w = data.weight
    for kind, name in ((0, "keys"), (1, "values")):
        centred = exact[:, kind] - exact[:, kind].mean(dim=-2, keepdim=True)
        out[name] += float(((decoded[:, kind] - exact[:, kind]) * w[:, kind].unsqueeze(-2)).double().pow(2).sum())
        out[name + "_ref"] += float((centred * w[:, kind].unsqueeze(-2)).double().pow(2).sum())
    for layer in range(L):
        cos, sin = data.rope.layer(layer)
        q = apply_rope(q_all[layer].transpose(0, 1), cos[T + data.query_positions], sin[T + data.query_positions],
                       **data.rope_layout)  # [Hq, Nq, d]
        q = q.reshape(H, n_rep * q.shape[1], d)
        results = []
        for x in (exact, decoded):
            k = apply_rope(x[layer, 0].float(), cos[:T], sin[:T], **data.rope_layout)
            p = torch.softmax(q @ k.transpose(-1, -2) * data.scaling, dim=-1)
            results.append(p @ x[layer, 1].float())
        out["attention"] += float((results[1] - results[0]).double().pow(2).sum())
        out["attention_ref"] += float(results[0].double().pow(2).sum())
    return out


def relative(errors: list[dict]) -> dict:
    """Each error over its reference, summed over blocks, as a relative L2 (square root)."""
    total = {k: sum(e[k] for e in errors) for k in errors[0]}
    return {k: (total[k] / total[k + "_ref"]) ** 0.5 for k in ("attention", "keys", "values")}


# --- today's codec and its variants ---------------------------------------------------------------

class _CentredStaging:
    """A staging whose blocks are another's, each unit's mean over its tokens removed (identity factors)."""

    def __init__(self, blocks: list[torch.Tensor]):
        self.means = [b.mean(dim=-2, keepdim=True) for b in blocks]
        self.centred = [b - m for b, m in zip(blocks, self.means)]

    def get(self, i: int):
        x = self.centred[i]
        d = x.shape[-1]
        return BlockFactors(A=x, S=torch.ones(*x.shape[:-2], d), B=torch.eye(d).expand(*x.shape[:-2], d, d))


def _decode_packed(packed: torch.Tensor, layout: Layout, ranks: np.ndarray, tokens: int) -> torch.Tensor:
    """A packed block back to pre-RoPE K/V [L, 2, H, T, d] through the kernels' CPU path (identity RoPE)."""
    L, H, d = layout.num_layers, layout.num_kv_heads, layout.head_dim
    offsets = layout.layer_offsets(ranks, tokens)
    cos, sin = torch.ones(tokens, d), torch.zeros(tokens, d)
    out = torch.zeros(L, 2, H, tokens, d)
    for layer in range(L):
        part = packed[offsets[layer]:offsets[layer + 1]].clone()  # a fresh (aligned) buffer per layer
        segments = torch.from_numpy(layout.layer_segments(layer, ranks[None, layer], np.array([tokens]), np.array([0]),
                                                          np.array([0])))
        reconstruct_layer(part, segments, out[layer, 0], out[layer, 1], cos, sin, quant=layout.quant,
                          backend="reference")
    return out


def run_today(data: StudyInput, ratio: float, *, centre: bool = False, coded: bool = False) -> dict:
    """`milo build`'s default codec at ``ratio`` (with each block's means removed and paid for when
    ``centre``; with a budget raised so that its Zstandard-coded bytes meet the ratio when ``coded``)."""
    config = default_compression(ratio, codec="svd")  # today's low-rank codec, whatever the default at ratio
    layout = quant_layout(data.layout, config.dtype)
    N = len(data.blocks)
    mean_bytes = N * layout.units_per_block * layout.head_dim * 2 if centre else 0
    staging = _CentredStaging(data.blocks) if centre else data.staging
    nominal = ratio - mean_bytes / data.full_bytes
    result = None
    for _ in range(3 if coded else 1):
        result = _today_at(data, replace(config, ratio=min(nominal, 1.0)), layout, staging, mean_bytes)
        if coded:
            nominal *= ratio * data.full_bytes / result["coded_bytes"]
    if not coded:
        result["bytes"] = result["plain_bytes"]
    else:
        result["bytes"] = result["coded_bytes"]
    return result


def _today_at(data: StudyInput, config, layout: Layout, staging, mean_bytes: int) -> dict:
    N = len(data.blocks)
    ranks, tokens = plan_ranks(staging, N, data.layout, config, channel_scale=data.channel_scale)
    source = pass_two_source(staging, N, config, channel_scale=data.channel_scale, layout=data.layout)
    plain = coded = index_bytes(layout, N) + mean_bytes
    errors = []
    for i in range(N):
        packed = pack_block(source.factors(i), ranks[i], config.dtype)
        plain += packed.numel()
        coded += zstd_bytes(packed.numpy().tobytes())
        if i in data.held_out:
            decoded = _decode_packed(packed, layout, ranks[i], int(tokens[i]))
            if isinstance(staging, _CentredStaging):
                decoded = decoded + staging.means[i]
            errors.append(attention_error(data, data.blocks[i], decoded))
    kept = ranks[ranks >= 0]
    return {"plain_bytes": plain, "coded_bytes": coded, "errors": errors,
            "note": f"ranks {int(kept.min()) if kept.size else '-'}-{int(kept.max()) if kept.size else '-'}, "
                    f"{int((ranks < 0).sum())} raw units"}


def run_bits(data: StudyInput, ratio: float, attended: bool = False) -> dict:
    """(b): per block, the query-weighted SVD's components each at their own width (store-wide choice);
    ``attended``: values' errors measured through the calibration queries' attention (`_fit_errors`)."""
    w = data.weight  # [L, 2, H, d]
    coeffs, bases = [], []
    for x in data.blocks:
        U, S, Vh = torch.linalg.svd(x * w.unsqueeze(-2), full_matrices=False)
        coeffs.append(U * S.unsqueeze(-2))  # [L, 2, H, T, n]
        bases.append(Vh.transpose(-1, -2))  # [L, 2, H, d, n]
    d = data.layout.head_dim
    errors = torch.cat([_fit_errors(data, c.reshape(-1, *c.shape[-2:]), x, attended).reshape(-1, len(WIDTHS))
                        for c, x in zip(coeffs, data.blocks)]).numpy()
    basis_bytes = d + 4  # INT8 codes of the basis column, its fp16 scale and minimum
    costs = np.concatenate([np.broadcast_to(column_bytes(c.shape[-2], np.array(WIDTHS)) + basis_bytes * (np.array(WIDTHS) > 0),
                                            (c[..., 0, :].numel(), len(WIDTHS))) for c in coeffs])
    budget = ratio * data.full_bytes - index_bytes(data.layout, len(data.blocks))
    choice = _split_allocation(errors, costs, budget, 0.5, data.layout.num_kv_heads, d)
    spent = int(costs[np.arange(len(choice)), choice].sum()) + index_bytes(data.layout, len(data.blocks))
    bits_all = np.array(WIDTHS)[choice]
    errs, pos = [], 0
    for i, (c, v) in enumerate(zip(coeffs, bases)):
        n = c[..., 0, :].numel()
        bits = torch.from_numpy(bits_all[pos:pos + n]).reshape(c.shape[:-2] + c.shape[-1:])
        pos += n
        if i in data.held_out:
            c_hat = roundtrip_columns(c, bits)
            v_hat = roundtrip_columns(v, 8) * (bits > 0).unsqueeze(-2)
            decoded = (c_hat @ v_hat.transpose(-1, -2)) / w.unsqueeze(-2)
            errs.append(attention_error(data, data.blocks[i], decoded))
    return {"bytes": spent, "errors": errs, "note": f"mean width {bits_all.mean():.2f} bits"}


def run_transform(data: StudyInput, ratio: float, *, fit: list[int] | None = None, coded: bool = False,
                  key_share: float | None = 0.5, attended: bool = False) -> dict:
    """The transform codec: a corpus mean and PCA basis per (layer, kind, head) fitted on ``fit`` blocks
    (default the even ones), one width per component chosen on them, measured on the held-out blocks.
    Keys get ``key_share`` of the coefficient budget and values the rest (None: one pool for both, their
    weighted errors compared as the query-aware weights scale them). ``attended``: a value component's
    error is measured through the calibration queries' attention on each fit block
    (`attended_column_errors`), a key's stays the weighted squared error."""
    fit = data.fit if fit is None else fit
    L, _, H, d = data.channel_scale.shape
    U = L * 2 * H
    w = data.weight.reshape(U, d)
    flat = [b.reshape(U, b.shape[-2], d) for b in data.blocks]
    transform = fit_transform([flat[i] for i in fit], w)
    coeffs = [transform.project(x) for x in flat]  # [U, T, d]
    errors = sum(_fit_errors(data, coeffs[i], data.blocks[i], attended) for i in fit).numpy().reshape(U * d, len(WIDTHS))
    tokens = data.tokens
    costs = np.stack([column_bytes(tokens, b).sum() for b in WIDTHS]).astype(np.float64)
    costs = np.broadcast_to(costs, (U * d, len(WIDTHS)))
    fixed = transform.stored_bytes() + index_bytes(data.layout, len(data.blocks))
    target = ratio * data.full_bytes - fixed
    budget, result = target, None
    for _ in range(3 if coded else 1):
        bits = torch.from_numpy(np.array(WIDTHS)[_split_allocation(errors, costs, budget, key_share, H, d)]).reshape(U, d)
        plain = coded_bytes = fixed
        errs = []
        for i, c in enumerate(coeffs):
            codes, scale, low = quantize_columns(c, bits)
            packed = pack_columns(codes, bits)
            plain += len(packed) + int((bits > 0).sum()) * 4
            coded_bytes += zstd_bytes(packed) + int((bits > 0).sum()) * 4
            if i in data.held_out:
                decoded = transform.reconstruct(dequantize_columns(codes, scale, low))
                errs.append(attention_error(data, data.blocks[i], decoded.reshape(data.blocks[i].shape)))
        result = {"plain_bytes": plain, "coded_bytes": coded_bytes, "errors": errs,
                  "note": f"mean width {bits.float().mean():.2f} bits, basis {transform.stored_bytes() / data.full_bytes:.4f} of the full K/V"}
        if coded:
            budget *= target / (coded_bytes - fixed)
    result["bytes"] = result["coded_bytes"] if coded else result["plain_bytes"]
    return result


def _fit_errors(data: StudyInput, coeffs: torch.Tensor, block: torch.Tensor, attended: bool) -> torch.Tensor:
    """[U, d, W] errors of one fit block's coefficients [U, T, d], values through attention if ``attended``."""
    errors = column_errors(coeffs)
    if attended:
        L, _, H, T, d = block.shape
        probs = attention_probs(data, block, data.calibration, data.calibration_positions)  # [L, H, M, T]
        by_kind = coeffs.reshape(L, 2, H, T, d)
        errors = errors.reshape(L, 2, H, d, -1)
        errors[:, 1] = attended_column_errors(by_kind[:, 1], probs)
        errors = errors.reshape(L * 2 * H, d, -1)
    return errors


def _split_allocation(errors, costs, budget: float, key_share: float | None, heads: int, d: int) -> np.ndarray:
    """`allocate_bits` over components laid out [layer, kind, head, component]: keys and values in one
    pool (``key_share`` None), or each in its own share of ``budget``."""
    if key_share is None:
        return allocate_bits(errors, costs, budget)
    kind = (np.arange(errors.shape[0]) // (d * heads)) % 2
    choice = np.zeros(errors.shape[0], dtype=np.int64)
    for k, share in ((0, key_share), (1, 1 - key_share)):
        choice[kind == k] = allocate_bits(errors[kind == k], costs[kind == k], budget * share)
    return choice


def run(data: StudyInput, codec: str, ratio: float) -> dict:
    """One codec at one ratio: measured ρ, relative errors (attention output, weighted K and V) and a note."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    runners = {"today": lambda: run_today(data, ratio), "today+mean": lambda: run_today(data, ratio, centre=True),
               "today+zstd": lambda: run_today(data, ratio, coded=True), "today+bits": lambda: run_bits(data, ratio),
               "today+bits+attn": lambda: run_bits(data, ratio, attended=True),
               "transform": lambda: run_transform(data, ratio),
               "transform-shared": lambda: run_transform(data, ratio, key_share=None),
               "transform+attn": lambda: run_transform(data, ratio, attended=True),
               "transform+zstd": lambda: run_transform(data, ratio, coded=True)}
    result = runners[codec]()
    out = {"codec": codec, "target": ratio, "measured": result["bytes"] / data.full_bytes, **relative(result["errors"]),
           "note": result["note"]}
    if "coded_bytes" in result and codec in ("today", "transform", "transform-shared", "transform+attn"):
        out["zstd"] = result["coded_bytes"] / data.full_bytes
    return out


def fit_sweep(data: StudyInput, ratio: float, counts=(1, 2, 4, 8), attended: bool = True) -> list[dict]:
    """The transform (``transform+attn`` unless not ``attended``) fitted on the first k fit blocks, for each
    k: tokens fitted on and held-out errors."""
    rows = []
    for k in counts:
        fit = data.fit[:k]
        if len(fit) < k:
            break
        result = run_transform(data, ratio, fit=fit, attended=attended)
        rows.append({"fit_blocks": k, "fit_tokens": int(data.tokens[fit].sum()),
                     "measured": result["bytes"] / data.full_bytes, **relative(result["errors"])})
    return rows


def staged_store(loaded, demos, task, out, seed: int = 0):
    """(store, staging) of `milo build`'s default build at ρ 0.25 of ``demos`` at ``out``, its staging kept at
    ``<out>.staging`` (built once; a later call reuses both)."""
    from milo_store import MiloStore
    from ..building.builder import build_store
    from ..building.config import BuildConfig
    out = Path(out)
    staging_dir = Path(f"{out}.staging")
    if not (out.is_dir() and (staging_dir / FINGERPRINT).is_file()):
        config = BuildConfig(seed=seed, compression=default_compression(0.25, seed))
        build_store(out, loaded, demos, task, config, force=True, progress=False, keep_staging=True,
                    staging_dir=staging_dir)
    return MiloStore.open(out), open_staging(staging_dir)
