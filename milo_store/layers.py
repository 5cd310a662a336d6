"""What each layer of a store holds: one `LayerSpec` per layer, the description every reader takes.

A store keeps, per block and layer, what the model caches there, described without the model (docs/format.md,
"Layers"), in the spirit of vLLM's ``kv_cache_interface`` (one spec per layer kind that allocator, scheduler and
connector all read):

- ``attention``: its own keys (before RoPE) and values, ``kv_heads`` heads of ``head_dim`` channels; RoPE turns
  its keys as ``rotary`` pairs them (rotate-half pairs (j, j + r/2) over the first ``rotary_dim`` channels, or the
  whole head; interleaved pairs (2i, 2i + 1)), or not at all (``nope``: a NoPE layer, rebuilt by identity tables). ``keys_from_values``: its keys are its values
  times a gain per channel (Gemma 4's ``attention_k_eq_v``, whose key and value are one projection, normalised by one
  RMSNorm with and one without a weight): only the values are stored, and the gain beside them (`format.KEY_GAIN`).
- ``shared``: nothing of its own; it attends layer ``source``'s keys and values (Gemma 4's ``num_kv_shared_layers``).
- ``latent``: multi-head latent attention's cache (DeepSeek's MLA): one unit a token, ``head_dim`` wide, its first
  ``head_dim − latent`` channels the rope key before RoPE (the rotary: rotate-half ``rotary_dim`` over them, or
  interleaved pairs whose tables past them are identity), the ``latent`` channels after it the compressed latent
  (after its norm), never rotated. It is stored as keys and holds no values: the model expands both K and V from it.
- ``linear``: a linear-attention layer keeps no K/V but a state per head, S [head_dim, value_dim] (``kv_heads``
  heads), which a block moves affinely: S_out = M S_in + C. Its ``rule`` says how: ``gated_delta`` (Gated DeltaNet:
  Qwen3.5, Qwen3-Next; ``head_dim`` the key dim) with M [heads, head_dim, head_dim] (`milo_infer.models.delta_rule`),
  or ``mamba2`` (Bamba's Mamba2; ``head_dim`` a head's channels, ``value_dim`` the state size) with M a scalar a head,
  [heads] (`milo_infer.models.ssd`). A block stores, as a *state section* at its layer's place, M, then C [heads,
  head_dim, value_dim], then its conv tail: the last ``conv_kernel`` − 1 inputs [conv_kernel − 1, conv_dim] of the
  layer's short convolution, which the next token reads. Its size is fixed, whatever the block's length
  (`state_values`). A ``conv`` rule (LFM2's gated short convolutions) keeps no recurrent state, only the conv tail (no
  heads: M and C are empty).
- ``mlp``: a layer that mixes no tokens (NemotronH's MLP and MoE blocks): it holds and attends nothing.

The rest of milo lays blocks out on a grid of (layer, kind, head) *units* (`milo_store.layout.Layout`): kind 0 the
keys, kind 1 the values, as many heads as the widest layer has, each unit as wide as its layer. A unit a layer does
not store (a shared layer's, a ``keys_from_values`` layer's keys, heads past its own) is *absent*: rank 0, no bytes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

ATTENTION, SHARED, LATENT, LINEAR, MLP = "attention", "shared", "latent", "linear", "mlp"
KINDS = (ATTENTION, SHARED, LATENT, LINEAR, MLP)
RULES = ("gated_delta", "mamba2", "conv")  # how a linear layer's state moves over a block
ROTARY = ("half", "interleaved")


@dataclass(frozen=True)
class LayerSpec:
    """One layer of a store (see the module docstring)."""
    kind: str = ATTENTION
    kv_heads: int = 0
    head_dim: int = 0
    rotary: str = "half"
    rotary_dim: int | None = None  # rotate-half over the first rotary_dim channels only (None: the whole head)
    nope: bool = False  # its keys are cached as computed, never rotated
    keys_from_values: bool = False
    source: int | None = None  # a shared layer: whose keys and values it attends
    latent: int = 0  # a latent layer: the latent's channels, after its rope key's
    value_dim: int = 0  # a linear layer: its state's value channels (head_dim: its key channels)
    conv_dim: int = 0  # a linear layer: its short convolution's channels
    conv_kernel: int = 0  # a linear layer: its short convolution's width (a block keeps the last conv_kernel - 1)
    rule: str = RULES[0]  # a linear layer: how its state moves (RULES)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown layer kind {self.kind!r}; expected one of {KINDS}")
        if self.rotary not in ROTARY:
            raise ValueError(f"unknown rotary layout {self.rotary!r}; expected one of {ROTARY}")
        if self.kind == SHARED and self.source is None:
            raise ValueError("a shared layer names the layer whose keys and values it attends (source)")
        if self.kind == LATENT and not (self.kv_heads == 1 and 0 < self.latent < self.head_dim):
            raise ValueError(f"a latent layer is one unit of a rope key and a latent of 1..head_dim-1 channels; got "
                             f"{self.kv_heads} heads of {self.head_dim} with a latent of {self.latent}")
        if self.kind == ATTENTION and (self.kv_heads < 1 or self.head_dim < 1):
            raise ValueError(f"an attention layer needs at least one KV head of at least one channel; got "
                             f"{self.kv_heads} heads of {self.head_dim}")
        if self.kind == LINEAR and min(self.conv_dim, self.conv_kernel, *(
                (self.kv_heads, self.head_dim, self.value_dim) if self.rule != "conv" else ())) < 1:
            raise ValueError(f"a linear layer needs its state's heads, key and value dims and its convolution's "
                             f"channels and width, each at least 1; got {self.kv_heads} heads of "
                             f"{self.head_dim}x{self.value_dim}, a convolution of {self.conv_dim}x{self.conv_kernel}")
        if self.rule not in RULES:
            raise ValueError(f"unknown linear rule {self.rule!r}; expected one of {RULES}")
        if self.kind == LINEAR and self.rule == "conv" and (self.kv_heads or self.head_dim or self.value_dim):
            raise ValueError("a short convolution (rule conv) keeps its conv tail alone: no state heads or dims")
        if self.rotary_dim is not None and (self.rotary != "half" or self.rotary_dim % 2
                                            or not 0 < self.rotary_dim < self.head_dim):
            raise ValueError(f"rotary_dim={self.rotary_dim}: a rotate-half rotary over an even part of the "
                             f"{self.head_dim}-channel head")

    @property
    def stores_keys(self) -> bool:
        return self.kind == LATENT or self.kind == ATTENTION and not self.keys_from_values

    @property
    def stores_values(self) -> bool:
        return self.kind == ATTENTION

    @property
    def holds_cache(self) -> bool:
        """Whether the layer caches keys and values of its own (a shared layer attends another's, a linear layer
        keeps a state instead)."""
        return self.kind in (ATTENTION, LATENT)

    @property
    def attends(self) -> bool:
        """Whether the layer is attention (over its own K/V or another layer's), not a linear layer's state or an MLP."""
        return self.kind in (ATTENTION, SHARED, LATENT)

    @property
    def state_values(self) -> int:
        """Values of a block's state section: a linear layer's M and C per head and its conv tail (0 elsewhere)."""
        if self.kind != LINEAR:
            return 0
        return (self.transition_values + self.kv_heads * self.head_dim * self.value_dim
                + (self.conv_kernel - 1) * self.conv_dim)

    @property
    def transition_values(self) -> int:
        """Values of a linear layer's M: a matrix a head (``gated_delta``) or a scalar (``mamba2``); none (``conv``)."""
        return self.kv_heads * (self.head_dim ** 2 if self.rule == "gated_delta" else 1)  # a conv rule's: no heads

    @property
    def caches_values(self) -> bool:
        """Whether its cache has values beside its keys (a latent layer's one unit is both)."""
        return self.kind == ATTENTION

    def rope_layout(self) -> dict:
        """The kernels' RoPE arguments for its keys (``milo_kernels`` ``interleaved``, ``rotary_dim``)."""
        return {"interleaved": self.rotary == "interleaved", "rotary_dim": self.rotary_dim}

    def record(self) -> dict:
        """Its JSON record in a store's attributes: its kind and the fields that differ from their defaults."""
        defaults = {f.name: f.default for f in fields(self)}
        return {k: v for k, v in asdict(self).items() if k == "kind" or v != defaults[k]}

    @classmethod
    def from_record(cls, record: dict) -> "LayerSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(record) - known
        if unknown:
            raise ValueError(f"a layer record with unknown fields {sorted(unknown)}: written by a newer milo")
        return cls(**record)


def uniform_layers(num_layers: int, kv_heads: int, head_dim: int, rotary: str = "half",
                   rotary_dim: int | None = None, unrotated=()) -> tuple[LayerSpec, ...]:
    """Every layer its own keys and values of one shape: every store written before per-layer descriptions."""
    return tuple(LayerSpec(ATTENTION, kv_heads, head_dim, rotary, rotary_dim, nope=l in unrotated)
                 for l in range(num_layers))


def grid(layers: tuple[LayerSpec, ...]) -> tuple[int, int]:
    """The unit grid's heads and width: the most heads and the widest head any layer stores."""
    stored = [spec for spec in layers if spec.holds_cache]
    return max((s.kv_heads for s in stored), default=0), max((s.head_dim for s in stored), default=0)


def present_units(layers: tuple[LayerSpec, ...]) -> np.ndarray:
    """bool [L, 2, H]: the units each layer stores (keys, then values, head by head)."""
    heads, _ = grid(layers)
    present = np.zeros((len(layers), 2, heads), dtype=bool)
    for l, spec in enumerate(layers):
        present[l, 0, :spec.kv_heads] = spec.stores_keys
        present[l, 1, :spec.kv_heads] = spec.stores_values
    return present


def unit_widths(layers: tuple[LayerSpec, ...]) -> np.ndarray:
    """int64 [L, 2, 1]: each layer's keys' and values' width (0 where it stores none), broadcast over heads."""
    return np.array([[[s.head_dim if s.stores_keys else 0], [s.head_dim if s.stores_values else 0]]
                     for s in layers], dtype=np.int64).reshape(len(layers), 2, 1)


def cache_values_per_token(layers) -> int:
    """Values one token's keys and values take in an attention cache: every layer holding its own (a K = V layer's
    both: the model attends both; a latent layer's one unit), none of a shared layer's."""
    return sum((1 + spec.caches_values) * spec.kv_heads * spec.head_dim for spec in layers if spec.holds_cache)


def check_layers(layers: tuple[LayerSpec, ...]) -> None:
    """A shared layer's source is an earlier attention layer that caches keys and values of its own."""
    for l, spec in enumerate(layers):
        if spec.kind == SHARED and not (0 <= spec.source < l and layers[spec.source].kind == ATTENTION):
            raise ValueError(f"layer {l} shares the keys and values of layer {spec.source}, which is not an earlier "
                             "attention layer holding its own")
