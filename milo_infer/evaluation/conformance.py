"""Whether milo reproduces a model: its stored K/V against the model's own cache, in a minute, before a long build.

On the model's own weights and in its dtype, over a few demonstrations, an identity store (every unit at
full rank, fp32 factors) is built the way `milo build` builds any store, and read back through the
engine's rebuild (the kernels, the family's RoPE tables):

* capture: each block rebuilt at the positions it was encoded at, [anchor][w previous blocks][block]:
  its keys and values must be what the model itself writes into its cache for those tokens in that row; at a hybrid's
  linear layer, its stored pair (M, C) applied to the model's state before it in that row must be the model's state
  after it, and its conv tail the model's last convolution inputs;
* re-positioning: the blocks placed as a query's prefix in reverse order (the first block always moves, by
  every other block's tokens; the others wherever their new neighbours' lengths differ from their context's): their
  rebuilt keys and values must be what the model computes for the same tokens at those positions from
  the same context (their encoding row fed at shifted positions; RoPE makes attention depend on
  relative positions only, so only the rotation differs);
* answering: the engine's logits for a query over that prefix must be a plain transformers forward of
  the query over a cache holding the same prefix (the engine's attention, the module's scaling included; at a linear
  layer, the state the rebuild composes from the blocks' pairs, run on by the model's own forward);
* query weights: the query-aware key weights (`query_channel_scales`, which read the family's query tap)
  against the queries the model's attention itself receives.

A deviation is the largest |milo − model| over the checked tokens, per layer, relative to the model's
largest magnitude there when that is above 1 (fp32 rounding grows with it: real keys reach hundreds).
The tolerances are per dtype (`TOLERANCES`); a description that reads the wrong tap (a missing
``k_norm``) or rotates a NoPE layer is off by the size of the keys themselves.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from milo_store import CompressionConfig, MiloStore
from milo_store.layers import LATENT

from ..building.builder import build_store
from ..building.config import BuildConfig
from ..models import FAMILIES, LoadedModel, latent, layer_rope_tables, layer_specs, query_channel_scales
from ..models.capture import pooled_key_scales, query_energy
from ..runtime.engine import Engine, cache_keyword
from ..runtime.planning import Request
from ..runtime.prefix import PrefixRebuild, carried
from ..tasks.corpus import Demonstration, TaskSpec

CHECKS = ("capture", "reposition")
# largest relative deviation each check may show, per model dtype: fp32 rounding (seen under 1e-6 on tiny
# models; up to 2.1e-5 on the tiny hybrids' anchors, encoded alone: a hidden state's last bits differ from the same
# tokens' inside a longer row and grow through three GDN layers, 6e-8 after the first, 2e-6 after the third), and the
# dtype's own rounding, where the model rotates in its dtype and milo in fp32
TOLERANCES = {
    torch.float32: {"capture": 3e-5, "reposition": 1e-4, "logits": 1e-4, "query_scales": 1e-5},
    torch.bfloat16: {"capture": 3e-2, "reposition": 1e-1, "logits": 1e-1, "query_scales": 3e-2},
    torch.float16: {"capture": 4e-3, "reposition": 2e-2, "logits": 2e-2, "query_scales": 4e-3},
}


@dataclass(frozen=True)
class Deviation:
    """One check's largest |milo − model| (``error``) over its tokens, and the model's largest |value| there."""
    error: float
    scale: float

    @property
    def relative(self) -> float:
        return self.error / max(1.0, self.scale)

    @classmethod
    def of(cls, ours: torch.Tensor, theirs: torch.Tensor) -> "Deviation":
        ours, theirs = ours.double(), theirs.double()
        return cls(float((ours - theirs).abs().max()), float(theirs.abs().max()))

    def worst(self, other: "Deviation") -> "Deviation":
        return self if self.relative >= other.relative else other


@dataclass
class Conformance:
    """Per layer, each check's deviation for keys and for values; the logits' and the query weights'."""
    model: str
    model_type: str
    dtype: torch.dtype
    blocks: int
    layers: list[dict[str, Deviation]] = field(default_factory=list)  # "capture keys", ..., "query_scales"
    logits: Deviation | None = None

    @property
    def tolerance(self) -> dict[str, float]:
        return TOLERANCES[self.dtype]

    def failures(self) -> list[str]:
        """Each deviation over its tolerance, named ('layer 3 capture keys: 0.41 > 1e-05')."""
        tol, out = self.tolerance, []
        for layer, checks in enumerate(self.layers):
            for name, dev in checks.items():
                limit = tol[name.split()[0]]
                if not dev.relative <= limit:
                    out.append(f"layer {layer} {name}: {dev.relative:.3g} > {limit:g}")
        if self.logits is not None and not self.logits.relative <= tol["logits"]:
            out.append(f"logits: {self.logits.relative:.3g} > {tol['logits']:g}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()

    def as_dict(self) -> dict:
        """JSON-ready: each layer's relative deviations, the logits', the tolerances and the verdict."""
        return {"model": self.model, "model_type": self.model_type, "dtype": str(self.dtype).removeprefix("torch."),
                "blocks": self.blocks, "tolerance": self.tolerance, "passed": self.passed, "failures": self.failures(),
                "layers": [{name: dev.relative for name, dev in layer.items()} for layer in self.layers],
                "logits": self.logits.relative if self.logits is not None else None}


def check_conformance(loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, query: str, *,
                      block_size: int = 2, context_blocks: int = 1, workdir=None) -> Conformance:
    """The four checks of this module over ``demos`` (at least two blocks of ``block_size``) and ``query``."""
    if len(demos) < 2 * block_size:
        raise ValueError(f"a conformance check needs two blocks or more: at least {2 * block_size} demonstrations "
                         f"of block size {block_size}, got {len(demos)}")
    with tempfile.TemporaryDirectory(prefix="milo-check-", dir=workdir) as tmp:
        config = BuildConfig(block_size=block_size, context_blocks=context_blocks, order="corpus",
                             compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
        build_store(Path(tmp) / "identity", loaded, demos, task, config, progress=False)
        with MiloStore.open(Path(tmp) / "identity") as store:
            return _check(loaded, store, query, context_blocks)


def _check(loaded: LoadedModel, store: MiloStore, query: str, w: int) -> Conformance:
    model, n = loaded.model, store.num_blocks
    engine = Engine(loaded, {"check": store})
    anchor = [int(t) for t in store.meta["build"]["anchor_token_ids"]]
    ids = [store.token_ids(b).tolist() for b in range(n)]
    starts = {}  # each block's first position in its own encoding row
    report = Conformance(loaded.identity["name"], model.config.model_type, engine.dtype, n,
                         [{} for _ in range(model.config.num_hidden_layers)])

    def record(check: str, got, want, kind: str) -> None:
        """``got`` and ``want`` per layer: lists over every layer, or dicts of some."""
        for layer, a in got.items() if isinstance(got, dict) else enumerate(got):
            if a is None:  # a layer that attends another's K/V holds none
                continue
            key = f"{check} {kind}"
            dev = Deviation.of(a, want[layer])
            report.layers[layer][key] = report.layers[layer][key].worst(dev) if key in report.layers[layer] else dev

    linear = [l for l, spec in enumerate(store.layout.layers) if spec.state_values]
    for b in range(n):  # capture: the block where its encoding row put it
        context = list(range(max(0, b - w), b + 1))
        starts[b] = len(anchor) + sum(len(ids[c]) for c in context[:-1])
        if linear:
            before = model_states(model, anchor + [t for c in context[:-1] for t in ids[c]])
            after = model_states(model, anchor + [t for c in context for t in ids[c]])
            block = store.layout.block_states(store.ranks[b], int(store.block_tokens[b]), store.stored_blocks([b])[0])
            for l in linear:
                if store.layout.layers[l].kv_heads:  # a short convolution keeps its conv tail alone
                    record("capture", {l: carried(block[l], before[l][0])}, {l: after[l][0]}, "state")
                record("capture", {l: block[l]["conv"]}, {l: after[l][1]}, "conv")
        k, v, _ = rebuilt(engine, engine.stores["check"].prefix.place(context))
        cached_k, cached_v = model_cache(model, anchor + [t for c in context for t in ids[c]], 0)
        span = slice(starts[b], starts[b] + len(ids[b]))
        for kind, ours, theirs in (("keys", k, cached_k), ("values", v, cached_v)):
            record("capture", cut(ours, span), cut(theirs, span), kind)
            record("capture", cut(ours, slice(len(anchor))), cut(theirs, slice(len(anchor))), kind)

    order = list(range(n))[::-1]  # a query's prefix in another order: blocks at other positions than encoded
    k, v, states = rebuilt(engine, engine.stores["check"].prefix.place(order))
    at = len(anchor)
    for b in order:
        context = list(range(max(0, b - w), b + 1))
        row = anchor + [t for c in context for t in ids[c]]
        cached_k, cached_v = model_cache(model, row, at - starts[b])
        theirs, ours = slice(starts[b], starts[b] + len(ids[b])), slice(at, at + len(ids[b]))
        record("reposition", cut(k, ours), cut(cached_k, theirs), "keys")
        record("reposition", cut(v, ours), cut(cached_v, theirs), "values")
        at += len(ids[b])

    plan = engine.plan("check", Request(text=query), block_ids=order)
    ours = engine.logits([plan])[0]
    report.logits = Deviation.of(ours, plain_logits(model, k, v, plan.query_ids, plan.prefix_tokens, states))
    calibration = anchor + [t for block in ids for t in block]
    for layer, (ours, theirs) in enumerate(zip(query_channel_scales(model, calibration),
                                               attended_query_scales(model, calibration))):
        if store.layout.layers[layer].attends:  # a linear layer reads no queries
            report.layers[layer]["query_scales"] = Deviation.of(ours, theirs)
    return report


def cut(tensors: list, columns: slice) -> list:
    """Each layer's [1, H, T, d] at ``columns`` (None stays None: a layer holding no K/V)."""
    return [None if x is None else x[:, :, columns] for x in tensors]


def rebuilt(engine: Engine, placement) -> tuple[list, list, dict]:
    """Per layer, K and V [1, H, P, d] of a placement's [anchor][blocks] as the engine's rebuild writes them into its
    cache (None at a layer that attends another's or a linear layer; a latent layer's unit as its keys, its values
    None), and each linear layer's state and conv window the rebuild composes (`PrefixRebuild.linear_states`)."""
    rebuild = PrefixRebuild([placement], engine.rope, engine.device)
    P = rebuild.rows[0].prefix_tokens
    keys, values, states = [], [], {}
    for layer, spec in enumerate(placement.prefix.layers):
        if spec.state_values:
            start = rebuild.linear_states(layer)[0]
            states[layer] = start.state, start.window
        if not spec.holds_cache:
            keys.append(None)
            values.append(None)
            continue
        k = torch.empty(1, spec.kv_heads, P, spec.head_dim, dtype=engine.dtype, device=engine.device)
        v = torch.empty_like(k) if spec.caches_values else None  # a latent layer's one unit is in its keys
        rebuild.fill(layer, [k[0]], [None if v is None else v[0]])
        keys.append(k)
        values.append(v)
    return keys, values, states


@torch.inference_mode()
def model_states(model, ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per linear layer, the state [H, dk, dv] the model's cache holds after ``ids`` and its convolution's last
    kernel − 1 inputs [kernel − 1, conv_dim]."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1,
                **{cache_keyword(model): DynamicCache(config=model.config)})
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return {l: (torch.zeros(0, 0, 0) if cache.layers[l].recurrent_states[0] is None  # a short convolution's: none
                else cache.layers[l].recurrent_states[0][0].float(), cache.layers[l].conv_states[0][0, :, 1:].mT)
            for l, spec in enumerate(layer_specs(model.config)) if spec.state_values}


@torch.inference_mode()
def model_cache(model, ids: list[int], shift: int) -> tuple[list, list]:
    """Per layer, the K and V [1, H, T, d] the model writes into its own cache for ``ids`` fed at positions
    ``shift``, ``shift + 1``, ...: RoPE'd where the layer rotates, as its attention reads them (None at a layer that
    attends another's: it writes none). The cache is one without a config, which keeps every token of every layer:
    a config's window layers would keep their last W (the model still attends within its windows: its masks make
    them)."""
    device = next(model.parameters()).device
    positions = torch.arange(len(ids), device=device)[None] + shift
    hybrid = getattr(FAMILIES.get(model.config.model_type), "linear", None)  # its linear layers need the config
    out = model(input_ids=torch.tensor([ids], device=device), position_ids=positions, use_cache=True,
                logits_to_keep=1, **{cache_keyword(model): DynamicCache(config=model.config) if hybrid else DynamicCache()})
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # transformers renamed it after 5.19
    # the layers that write K/V come first (Gemma 4's shared layers are its last ones): the others hold none
    held = list(cache.layers) + [None] * (model.config.num_hidden_layers - len(cache.layers))
    keys, values = ([getattr(c, "keys", None) for c in held],  # a linear layer's holds a state, no K/V
                    [getattr(c, "values", None) for c in held])
    if getattr(FAMILIES.get(model.config.model_type), "latent", False):  # (latent, rotated rope key) as milo's unit
        keys, values = [latent.unit_of(k, v) for k, v in zip(keys, values)], [None] * len(keys)
    return keys, values


@torch.inference_mode()
def plain_logits(model, keys, values, query_ids: list[int], prefix_tokens: int, states=None) -> torch.Tensor:
    """transformers alone: the query fed after a `DynamicCache` holding the prefix, its logits [T, vocab] fp32
    (every column kept, as `model_cache`'s; ``states``: each linear layer's state and conv window)."""
    dtype = next(model.parameters()).dtype  # the convolution reads its inputs in the model's dtype
    states = {l: (state, window.to(dtype)) for l, (state, window) in (states or {}).items()}
    cache = cache_of(keys, values, layers=layer_specs(model.config), states=states,
                     config=model.config if states else None)
    device = next(model.parameters()).device
    positions = torch.arange(prefix_tokens, prefix_tokens + len(query_ids), device=device)[None]
    out = model(input_ids=torch.tensor([query_ids], device=device), position_ids=positions, use_cache=True,
                **{cache_keyword(model): cache})
    return out.logits[0].float()


def cache_of(keys: list, values: list, config=None, layers=None, states=None) -> DynamicCache:
    """A `DynamicCache` holding each layer's K and V (none at a layer that attends another's); ``config``: the model's,
    for a cache that keeps only a window layer's last W columns as it grows (and a hybrid's, for its linear layers);
    ``layers`` (the model's `layer_specs`, default ``config``'s): a latent layer's unit handed back as its model
    caches it; ``states``: each linear layer's state [H, dk, dv] and conv window [kernel − 1, conv_dim]."""
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    layers = layers or (layer_specs(config) if config is not None else ())
    for layer, (k, v) in enumerate(zip(keys, values)):
        if k is not None and layer < len(layers) and layers[layer].kind == LATENT:
            k, v = latent.cache_pair(k, layers[layer].latent)
        if k is not None:
            cache.update(k, v, layer)
    for layer, (state, window) in (states or {}).items():  # the conv state's oldest column is never read again
        conv = torch.cat((window.new_zeros(1, window.shape[1]), window)).mT[None]
        cache.update_conv_state(conv, layer)
        cache.update_recurrent_state(state[None], layer)
    return cache


RECORDING = "milo_record_queries"
_RECORDED: list[dict] = []  # where the `attended_query_scales` call in progress keeps each layer's queries (not a
# forward keyword: StableLM's decoder layers do not hand their keywords on to the attention)


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention (windows, sinks, soft-cap as its modeling file has them), keeping what each
    layer's attention is given as queries (after RoPE and any norm)."""
    if _RECORDED:  # an MLA layer's queries as one over its unit [rope key | latent], which its keys' weights are of
        mla = hasattr(module, "kv_b_proj")  # the module alone is at hand here
        _RECORDED[-1][module.layer_idx] = (latent.absorbed_query(module, query) if mla else query).detach()
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(RECORDING, _recording_attention)
AttentionMaskInterface.register(RECORDING, eager_mask)  # the masks eager attention takes, windows included


@torch.inference_mode()
def attended_query_scales(model, ids: list[int]) -> torch.Tensor:
    """`query_channel_scales`' quantity [L, H_kv, d] from the queries the model's attention receives: the RMS
    over tokens and each KV head's query group of each channel, pooled over RoPE pairs (a pair's energy is the
    same rotated or not, so the attention's post-RoPE queries give what the pre-RoPE tap must, once a scale the
    rotary tables carry, YaRN's, is divided out: cos² + sin² at position 0)."""
    config = model.config
    seen: dict[int, torch.Tensor] = {}
    before = config._attn_implementation
    config._attn_implementation = RECORDING
    _RECORDED.append(seen)
    try:
        model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), use_cache=False)
    finally:
        _RECORDED.pop()
        config._attn_implementation = before
    tables = layer_rope_tables(model, 1)
    return pooled_key_scales(layer_specs(config), {  # each layer's [tokens, Hq, d] over its tables' carried scale
        layer: query_energy(config, layer, seen[layer][0].transpose(0, 1)) / float(tables.layer(layer)[0][0, 0]) ** 2
        for layer in seen})  # a linear layer attends nothing
