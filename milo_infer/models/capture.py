"""A layer's keys before RoPE and its values, read where the family's description says (`families.Attention`),
and the query-aware channel weights, which read its queries the same way."""
from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch

from milo_store.layers import LATENT

from . import latent
from .families import Attention, attention_of, layer_specs
from .quantized import dense_weight


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM (``model.model.layers``) or of its base model."""
    base = getattr(model, "model", model)
    return base.layers


def attention_modules(model) -> list[torch.nn.Module]:
    """Every attention module in the order the model's cache numbers them: each decoder layer's ``self_attn``, or each
    of its list (LongCat's two a layer), or a hybrid's linear layer's module (`Attention.linear`) in its place."""
    found = []
    linear = attention_of(model.config).linear
    for layer in decoder_layers(model):
        attention = getattr(layer, "self_attn", None) or getattr(layer, linear)
        found.extend(attention if isinstance(attention, torch.nn.ModuleList) else [attention])
    return found


def _module(attention: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.nn.Module, bool]:
    """The first of ``names`` the attention module has (a description lists the tap first, its fallback after), and
    whether it is the first (the tap, not its fallback)."""
    for index, name in enumerate(names):
        if (found := getattr(attention, name, None)) is not None:
            return found, index == 0
    raise AttributeError(f"{type(attention).__name__} has none of {', '.join(names)}: its family's description "
                         "(milo_infer/models/families.py) does not fit this transformers version")


def _taps(model, spec: Attention, what: str) -> dict:
    """Per layer, (module to hook, a function of its output giving the wanted part [batch, tokens, heads * d] or
    [batch, tokens, heads, d]): ``what`` is "q", "k" or "v". A layer that attends another's K/V (`layer_specs`'
    shared layers) has no key or value tap."""
    config = model.config
    taps = {}
    for index, (attention, shape) in enumerate(zip(attention_modules(model), layer_specs(config))):
        if not shape.attends or what != "q" and not shape.holds_cache:
            continue
        if spec.latent:  # the rope key ends the projection's output; the latent is its norm's; queries absorbed
            taps[index] = _latent_tap(attention, spec, what, shape.latent, latent.rope_order(config, spec))
            continue
        d = shape.head_dim
        sizes = {"q": config.num_attention_heads * d, "k": shape.kv_heads * d, "v": shape.kv_heads * d}
        if spec.fused is not None:  # [q | k | v] along the last dimension
            start = {"q": 0, "k": sizes["q"], "v": sizes["q"] + sizes["k"]}[what]
            taps[index] = (getattr(attention, spec.fused), lambda out, a=start, b=start + sizes[what]: out[..., a:b])
        else:
            names = {"q": spec.queries, "k": spec.keys, "v": (spec.values,)}[what]
            module, first = _module(attention, names)
            norm = getattr(attention, spec.norm_after_rope, None) if spec.norm_after_rope and what != "v" else None
            if spec.heads_first and what != "v" and first:  # [batch, heads, tokens, d] -> [batch, tokens, heads, d]
                taps[index] = (module, lambda out: out.transpose(1, 2))
            elif norm is not None:  # it commutes with RoPE (weightless): normed per head before it as after
                taps[index] = (module, lambda out, norm=norm, d=d: norm(out.unflatten(-1, (-1, d))))
            else:
                taps[index] = (module, lambda out: out)
    return taps


def _latent_tap(attention, spec: Attention, what: str, width: int, order) -> tuple:
    """An MLA layer's tap (`models.latent`): its rope key (in its cache's layout), its latent, or its pre-RoPE queries
    absorbed into one over [rope key | latent], [batch, tokens, heads * (rope + latent)]."""
    latent_gain, query_gain = latent.gains(attention, spec)
    if what == "k":
        return _module(attention, spec.keys)[0], lambda out: latent.laid_out(out[..., width:], order)
    if what == "v":
        return _module(attention, (spec.values,))[0], lambda out: out * latent_gain

    def absorbed(out):
        q = (out * query_gain).unflatten(-1, (attention.num_heads, -1))  # [batch, tokens, heads, nope + rope]
        nope = attention.qk_nope_head_dim
        q = torch.cat((q[..., :nope], latent.laid_out(q[..., nope:], order)), dim=-1)
        return latent.absorbed_query(attention, q.transpose(1, 2)).transpose(1, 2).flatten(-2)
    return _module(attention, spec.queries)[0], absorbed


def hand_on_attention_keywords(model) -> None:
    """Hand each decoder layer's forward keywords that it does not name itself on to its ``self_attn``, as most
    families' layers do and StableLM's and Nemotron's do not: the engine's attention reads its batch from one
    (``milo_pack``), and a layer that kept it would attend plain SDPA over the engine's pools. Once per model."""
    for layer in decoder_layers(model):
        if getattr(layer, "_milo_hands_on_keywords", False):
            continue
        named = set(inspect.signature(layer.forward).parameters)
        held: dict = {}

        def keep(module, args, kwargs, held=held, named=named):
            held.update({k: v for k, v in kwargs.items() if k not in named})

        def hand_on(module, args, kwargs, held=held):
            return args, {**held, **kwargs}

        def release(module, args, output, held=held):
            held.clear()  # the batch is not kept past the layer's forward

        layer.register_forward_pre_hook(keep, with_kwargs=True)
        layer.self_attn.register_forward_pre_hook(hand_on, with_kwargs=True)
        layer.register_forward_hook(release)
        layer._milo_hands_on_keywords = True


class CapturedKV:
    """Pre-RoPE keys and values of the latest forward pass, per layer.

    ``keys[l]`` is what layer ``l``'s RoPE turns (the family's key tap: ``k_proj``'s output with its bias, or
    ``k_norm``'s, or the k slice of a fused projection) and ``values[l]`` its values, both reshaped to
    ``[batch, tokens, kv_heads, head_dim]`` of that layer (``layers``: `families.layer_specs`); at a latent layer its
    rope key and its latent, [batch, tokens, 1, width] each. A layer not yet run, or one that attends another's K/V,
    holds None. Each forward pass replaces the previous one's tensors.
    """

    def __init__(self, layers):
        self.layers = tuple(layers)
        self.keys: list[torch.Tensor | None] = [None] * len(self.layers)
        self.values: list[torch.Tensor | None] = [None] * len(self.layers)

    def _store(self, into: list, layer: int, part):
        heads = self.layers[layer].kv_heads

        def hook(module, inputs, output):
            x = part(output.detach())
            into[layer] = x.reshape(*x.shape[:2], heads, -1)
        return hook

    def unit(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer``'s keys and values [batch, tokens, heads, d] as its store unit lays them: a latent layer's
        one unit [rope key | latent], no values."""
        if self.layers[layer].kind == LATENT:
            return torch.cat((self.keys[layer], self.values[layer]), dim=-1), None
        return self.keys[layer], self.values[layer]

    def grid(self, batch: int, tokens: slice, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``batch``'s keys and values at ``tokens`` on ``layout``'s grid, each [L, H, T, d] on their device: zero
        at a layer holding none (a shared layer) and past a layer's heads and width. A K = V layer's keys are there
        too, which the layout does not store (`Layout.present`)."""
        held = [x for x in self.values if x is not None]
        T = len(range(*tokens.indices(held[0].shape[1])))
        keys = torch.zeros(layout.num_layers, layout.num_kv_heads, T, layout.head_dim, device=held[0].device)
        values = torch.zeros_like(keys)
        for l, spec in enumerate(self.layers):
            if spec.holds_cache:
                k, v = self.unit(l)
                keys[l, :spec.kv_heads, :, :spec.head_dim] = k[batch, tokens].transpose(0, 1)
                if v is not None:
                    values[l, :spec.kv_heads, :, :spec.head_dim] = v[batch, tokens].transpose(0, 1)
        return keys, values


@contextlib.contextmanager
def capture_kv(model, spec: Attention | None = None) -> Iterator[CapturedKV]:
    """Hook every layer's key and value taps (``spec``, default the family's) while the block runs; yield a
    `CapturedKV`.

    The hooks are removed on exit, even on error. Run the forward passes inside the block and read
    ``captured.keys[l]`` / ``captured.values[l]`` (the latest pass) inside or after it.
    """
    config = model.config
    spec = spec or attention_of(config)
    captured = CapturedKV(layer_specs(config))
    handles = []
    try:
        for kind, into in (("k", captured.keys), ("v", captured.values)):
            for index, (module, part) in _taps(model, spec, kind).items():
                handles.append(module.register_forward_hook(captured._store(into, index, part)))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_linear_inputs(model) -> Iterator[dict[int, torch.Tensor]]:
    """Hook every linear layer's module (`layer_specs`' ``linear``) while the block runs; yield {layer: its input
    hidden states [batch, tokens, hidden] of the latest forward pass}, from which `delta_rule.block_section` computes a
    block's state section. Empty for a model without linear layers."""
    inputs: dict[int, torch.Tensor] = {}
    handles = []
    try:
        for index, (module, shape) in enumerate(zip(attention_modules(model), layer_specs(model.config))):
            if shape.state_values:
                handles.append(module.register_forward_pre_hook(
                    lambda module, args, kwargs, index=index: inputs.__setitem__(
                        index, (args[0] if args else kwargs["hidden_states"]).detach()), with_kwargs=True))
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


def linear_rule(spec):
    """The module computing a linear layer's state (`LayerSpec.rule`): `delta_rule` (Gated DeltaNet), `ssd` (Mamba2) or
    `short_conv` (LFM2's), each with `block_section`, `layer_step`, `layer_steps` (several rows at once) and
    `zero_state`."""
    from . import delta_rule, short_conv, ssd

    return {"gated_delta": delta_rule, "mamba2": ssd, "conv": short_conv}[spec.rule]


def rope_pairs(energy: torch.Tensor, interleaved: bool, rotary_dim: int | None = None) -> torch.Tensor:
    """Each channel's value replaced by the mean over its RoPE pair: (j, j + d/2) rotate-half, (2i, 2i + 1)
    interleaved; with a rotate-half ``rotary_dim``, (j, j + rotary_dim/2) over the first rotary_dim channels, each
    channel after them its own (nothing turns it)."""
    d = energy.shape[-1]
    if interleaved:
        return energy.unflatten(-1, (d // 2, 2)).mean(-1).repeat_interleave(2, dim=-1)
    r = d if rotary_dim is None else rotary_dim
    pair = (energy[..., :r // 2] + energy[..., r // 2:r]) / 2
    return torch.cat((pair, pair, energy[..., r:]), dim=-1)


def query_channel_scales(model, input_ids, spec: Attention | None = None) -> torch.Tensor:
    """Key channel weights [L, H_kv, d] on the layers' grid (`milo_store.layout.Layout`: zero past a layer's heads and
    width): the RMS of the pre-RoPE queries that read each key channel.

    Query head g scores a key by (R_m q)·(R_n k) (RoPE R, the 1/√d all scores share left out), so a
    key error δk moves it by (R_m q)·(R_n δk). Taking channels as uncorrelated, its mean square over
    the calibration tokens and the query heads sharing this KV head (GQA) is Σ_j s_j² (R_n δk)_j² with
    s_j² the mean of the rotated q_j²: a weighted error, which the SVD of K diag(s) minimises. RoPE
    turns each pair of channels by one angle, so s is pooled over the pair, s_j² = s_{j'}² =
    mean(q_j² + q_{j'}²) / 2. A pair's energy is the same rotated or not, so this s is the same
    from pre- or post-RoPE queries, and diag(s) commutes with R: the weighted error of the stored
    pre-RoPE keys is exactly that of the rotated keys the scores use. A per-channel s would be neither.
    The queries are read where the family's description says (after ``q_norm`` where it has one); a layer that
    attends another's K/V adds its queries' energy to that layer's (both read its keys).
    """
    config = model.config
    spec = spec or attention_of(config)
    ids = torch.as_tensor(input_ids, device=model.device).reshape(1, -1)
    if ids.numel() == 0:
        raise ValueError("query channel scales need at least one calibration token")
    layers, energy = layer_specs(config), {}

    def store(layer: int, q: torch.Tensor):
        energy[layer] = query_energy(config, layer, q.reshape(-1, config.num_attention_heads, layers[layer].head_dim))

    _forward_reading_queries(model, spec, ids, store)
    return pooled_key_scales(layers, energy)


def query_energy(config, layer: int, q: torch.Tensor) -> torch.Tensor:
    """Each key channel's mean square of the queries ``q`` [tokens, H_q, d] of ``layer`` that read it: [H_kv, d] (query
    heads h·n_rep.. read KV head h)."""
    H = layer_specs(config)[layer].kv_heads
    return q.double().reshape(q.shape[0], H, q.shape[1] // H, q.shape[2]).square().mean(dim=(0, 2)).cpu()


def pooled_key_scales(layers, energy: dict[int, torch.Tensor]) -> torch.Tensor:
    """Key channel weights [L, H, d] on the layers' grid from each layer's query energy [H_l, d_l]: a layer holding K/V
    takes the mean over its readers (itself and the layers that share its K/V), pooled over its RoPE pairs."""
    weights, readers = _grid(layers, torch.float64), _readers(layers)
    for l, shape in enumerate(layers):
        if not shape.attends:  # a linear layer's state: no keys
            continue
        owner = l if shape.holds_cache else shape.source
        weights[owner, :shape.kv_heads, :shape.head_dim] += energy[l]
    for l, shape in enumerate(layers):
        if shape.holds_cache:  # a latent layer's pairs are its rope key's; its latent never turns
            H, d = shape.kv_heads, shape.head_dim - shape.latent
            weights[l, :H, :shape.head_dim] /= readers[l]
            weights[l, :H, :d] = rope_pairs(weights[l, :H, :d], **shape.rope_layout())
    return weights.sqrt().float()


def output_channel_scales(model, spec: Attention | None = None) -> torch.Tensor:
    """Value channel weights [L, H_kv, d] on the layers' grid: the RMS over query heads of o_proj's column norms (the
    family's output projection's; over the query heads of every layer that attends a layer's values).

    Attention mixes values row-wise, so an error in value channel j of a KV head reaches the layer's
    output through o_proj's column for channel j of each query head sharing that KV head; its size
    there is that column's norm, pooled as an RMS over those heads. No activations are needed.
    """
    config = model.config
    spec = spec or attention_of(config)
    layers = layer_specs(config)
    squares = _grid(layers, torch.float64)
    for index, (attention, shape) in enumerate(zip(attention_modules(model), layers)):
        if shape.kind == LATENT or not shape.attends:  # no values of its own (its latent is stored as keys; a state)
            continue
        owner = index if shape.holds_cache else shape.source
        H, d = shape.kv_heads, shape.head_dim
        squares[owner, :H, :d] += (dense_weight(getattr(attention, spec.output)).detach().double().square().sum(dim=0)
                                   .reshape(H, config.num_attention_heads // H, d).mean(dim=1).cpu())
    readers = _readers(layers)
    return (squares / readers.reshape(-1, 1, 1)).sqrt().float()


def _grid(layers, dtype) -> torch.Tensor:
    """Zeros [L, H, d] on the layers' grid (the most heads and the widest head a layer holds)."""
    held = [s for s in layers if s.holds_cache]
    return torch.zeros(len(layers), max(s.kv_heads for s in held), max(s.head_dim for s in held), dtype=dtype)


def _readers(layers) -> torch.Tensor:
    """Per layer, how many layers attend its K/V: itself and those that share them (1 for a layer holding none)."""
    count = torch.ones(len(layers), dtype=torch.float64)
    for shape in layers:
        if shape.source is not None:
            count[shape.source] += 1
    return count
def key_gains(model) -> torch.Tensor | None:
    """Each K = V layer's gain [L, d] on the layers' grid (zeros elsewhere): its key tap's weight (Gemma 4's k_norm),
    the keys being the values (its weightless v_norm's output) times it; None where no layer is K = V."""
    layers = layer_specs(model.config)
    if not any(shape.keys_from_values for shape in layers):
        return None
    spec, gains = attention_of(model.config), _grid(layers, torch.float32)[:, 0]
    for index, (attention, shape) in enumerate(zip(attention_modules(model), layers)):
        if shape.keys_from_values:
            gains[index, :shape.head_dim] = _module(attention, spec.keys)[0].weight.detach().float().cpu()
    return gains


def channel_scales(model, input_ids) -> torch.Tensor:
    """Query-aware channel weights [L, 2, H_kv, d]: keys from the queries over ``input_ids``
    (a calibration sample), values from ``o_proj``."""
    return torch.stack((query_channel_scales(model, input_ids), output_channel_scales(model)), dim=1)


def capture_queries(model, input_ids, spec: Attention | None = None) -> torch.Tensor:
    """Pre-RoPE queries [L, T, H_q, d] of one forward pass over ``input_ids`` (read where the family's
    description reads them, as `query_channel_scales` does; zero past a layer's width): what a study of the error the
    model sees scores stored keys with."""
    config = model.config
    spec = spec or attention_of(config)
    layers, Hq = layer_specs(config), config.num_attention_heads
    ids = torch.as_tensor(input_ids, device=model.device).reshape(1, -1)
    if ids.numel() == 0:
        raise ValueError("capturing queries needs at least one token")
    queries = torch.zeros(len(layers), ids.shape[1], Hq, max(shape.head_dim for shape in layers))

    def store(layer: int, q: torch.Tensor):
        d = layers[layer].head_dim
        queries[layer, :, :, :d] = q.float().reshape(-1, Hq, d).cpu()

    _forward_reading_queries(model, spec, ids, store)
    return queries


def _forward_reading_queries(model, spec: Attention, ids: torch.Tensor, store) -> None:
    """One forward pass over ``ids`` calling ``store(layer, queries)`` with each layer's pre-RoPE queries, read
    where the family's description reads them."""
    handles = []
    try:
        for index, (module, part) in _taps(model, spec, "q").items():
            handles.append(module.register_forward_hook(
                lambda module, inputs, output, index=index, part=part: store(index, part(output.detach()))))
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
