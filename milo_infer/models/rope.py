"""RoPE tables from the model's own rotary module (so scaled variants match it exactly), per layer.

Every rotating layer of a model shares one table; a layer without RoPE (SmolLM3's NoPE layers) gets
identity tables, cos 1 and sin 0, which the kernels apply as they apply any table: x·1 + partner·0 is x
to the bit. So the rebuild needs no special case and no kernel change for NoPE layers. A model with a RoPE per
layer type (Gemma 3's local base 10k and global 1M) has a table per type, each layer taking its type's.
"""
from __future__ import annotations

import importlib

import torch

from .families import attention_of, layer_specs, rope_per_layer_type


class RopeTables:
    """Each layer's fp32 (cos, sin), [positions, that layer's head_dim]: ``cos``/``sin`` for the layers that rotate
    (``by_layer`` for those with a table of their own), identity tables for those in ``nope``."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, num_layers: int, nope=(), by_layer=None):
        self.cos, self.sin, self.num_layers, self.nope = cos, sin, num_layers, frozenset(nope)
        self.by_layer = dict(by_layer or {})
        self._identity: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per width
        self._turns: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of a {self.num_layers}-layer model")
        cos, sin = self.by_layer.get(index, (self.cos, self.sin))
        if index in self.nope:
            if cos.shape[1] not in self._identity:
                self._identity[cos.shape[1]] = (torch.ones_like(cos), torch.zeros_like(sin))
            return self._identity[cos.shape[1]]
        return cos, sin

    def turn(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation alone of layer ``index``'s tables: (cos, sin) over their magnitude, which scaled RoPE (YaRN's,
        LongRoPE's attention factor) folds into them. Turning an already rotated query back by an offset p with these
        (x·cos[p] − rotate(x)·sin[p]) moves it by −p and leaves its scale as it was: what attends a block held at
        positions 0..T-1 for a row that places it at p (`milo_infer.runtime.attention`)."""
        cos, sin = self.layer(index)
        if id(cos) not in self._turns:
            magnitude = torch.hypot(cos, sin)
            self._turns[id(cos)] = (cos / magnitude, sin / magnitude)
        return self._turns[id(cos)]


def layer_rope_tables(model, n_rows: int, device=None) -> RopeTables:
    """`RopeTables` of ``model`` for positions ``0..n_rows-1``: its rotary module's, NoPE layers as its family says."""
    return _per_layer(model.config, lambda kind: rope_tables(model, n_rows, device, kind), n_rows, device)


def config_layer_rope_tables(config, n_rows: int, device=None) -> RopeTables:
    """`layer_rope_tables` without the model (the vLLM connector has its config only)."""
    return _per_layer(config, lambda kind: config_rope_tables(config, n_rows, device, kind), n_rows, device)


def _per_layer(config, tables_of, n_rows: int, device=None) -> RopeTables:
    """``tables_of(layer_type)``: the rotary module's tables for that type (None: the model's one RoPE), each laid
    out for the head width of the layers it turns (`layer_specs`); identity tables of ``n_rows`` where no layer
    rotates."""
    per_type = rope_per_layer_type(config)
    layers = layer_specs(config)
    nope = [l for l, spec in enumerate(layers) if spec.nope]
    if not per_type:
        width = next(spec.head_dim for spec in layers if spec.attends)  # a hybrid's linear layers turn nothing
        if all(spec.nope for spec in layers if spec.attends):  # no layer rotates: the model may have no rotary module
            return RopeTables(torch.ones(n_rows, width, device=device), torch.zeros(n_rows, width, device=device),
                              config.num_hidden_layers, range(config.num_hidden_layers))
        return RopeTables(*_as_applied(config, *tables_of(None), width), config.num_hidden_layers, nope)
    kinds = list(config.layer_types)
    width = {kind: layers[kinds.index(kind)].head_dim for kind in per_type if kind in kinds}
    tables = {kind: _as_applied(config, *tables_of(kind), d) for kind, d in width.items()}
    return RopeTables(*tables[kinds[0]], config.num_hidden_layers, nope,
                      by_layer={layer: tables[kind] for layer, kind in enumerate(kinds)})


def _as_applied(config, cos, sin, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary module's tables laid out as the family's attention applies them to [d] channels."""
    spec = attention_of(config)
    if spec.half_tables:  # one table per pair: (j, j + d/2) the same for both halves, (2i, 2i + 1) for both channels
        cos, sin = (t.repeat_interleave(2, dim=1) if spec.interleaved else torch.cat((t, t), dim=1) for t in (cos, sin))
    if spec.regroup_tables:  # [f_0 .. f_{r/2-1}, f_0 .. f_{r/2-1}] -> [f_0, f_0, f_1, f_1, ...]
        cos, sin = (t[:, :t.shape[1] // 2].repeat_interleave(2, dim=1) for t in (cos, sin))
    if cos.shape[1] != d:  # partial rotary (a latent layer's latent after its rope key too): the channels past
        # rotary_dim are kept as they are
        if not (spec.partial or spec.latent) or cos.shape[1] > d:
            raise ValueError(f"{config.model_type}: rotary tables of {cos.shape[1]} channels for heads of {d}")
        cos = torch.cat((cos, cos.new_ones(cos.shape[0], d - cos.shape[1])), dim=1)
        sin = torch.cat((sin, sin.new_zeros(sin.shape[0], d - sin.shape[1])), dim=1)
    return cos, sin


def rope_tables(model, n_rows: int, device=None, layer_type=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)``, each ``[n_rows, head_dim]``, for positions ``0..n_rows-1``.

    They come from the model's own rotary module, so scaled variants (linear, yarn, llama3) and any
    attention scaling folded into cos/sin match the model exactly. They are laid out as that module makes
    them (rotate-half's, Cohere's interleaved); `RopeTables` holds them as the family's attention applies
    them, for ``milo_kernels.naive.apply_rope(x, cos, sin, interleaved)``. ``layer_type``: that type's tables,
    where the model has a RoPE per layer type.
    """
    rotary = getattr(model, "model", model).rotary_emb
    device = torch.device(device) if device is not None else next(rotary.buffers()).device
    return _rotary_tables(rotary, n_rows, device, layer_type)


def config_rope_tables(config, n_rows: int, device=None, layer_type=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables` without the model: its architecture's rotary module, made from ``config`` alone."""
    # the config class's own package (gemma3_text's is gemma3's); a vision tower's rotary there (Qwen-VL's, Gemma 4's)
    # is not it
    modeling = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    rotary_classes = [obj for name, obj in vars(modeling).items() if name.endswith("RotaryEmbedding")
                      and "Vision" not in name and isinstance(obj, type) and obj.__module__ == modeling.__name__]
    if len(rotary_classes) != 1:
        raise ValueError(f"cannot tell the rotary embedding of model type {config.model_type!r} "
                         f"({len(rotary_classes)} candidates in {modeling.__name__})")
    device = torch.device(device) if device is not None else torch.device("cpu")
    return _rotary_tables(rotary_classes[0](config=config).to(device), n_rows, device, layer_type)


def _rotary_tables(rotary, n_rows: int, device: torch.device, layer_type=None) -> tuple[torch.Tensor, torch.Tensor]:
    probe = torch.empty(0, dtype=torch.float32, device=device)  # only its dtype and device are read
    positions = torch.arange(n_rows, device=device)[None]
    with torch.no_grad():
        tables = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    cos, sin = (tables.real, tables.imag) if torch.is_tensor(tables) else tables  # Llama 4's: e^{iθ} per pair
    return cos[0].float(), sin[0].float()
