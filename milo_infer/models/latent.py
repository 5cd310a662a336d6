"""Multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2, GLM-4.7-Flash, LongCat-Flash) as milo keeps it.

An MLA layer caches, per token, a latent ``c`` (``kv_lora_rank`` channels, after ``kv_a_layernorm``) and one rope
key ``k_r`` (``qk_rope_head_dim``) shared by every head; its attention expands them through ``kv_b_proj``: head h's key
is [W_uk,h c | k_r], its value W_uv,h c. milo keeps them as one unit a token, [k_r | c] (`milo_store.layers`' latent
kind: the rope key first, so the kernels' rotate-half ``rotary_dim`` turns it and leaves the latent), and attends it
*absorbed*: head h's query [q_nope,h | q_r,h] becomes [q_r,h | q_nope,h W_uk,h], whose product with [k_r | c] is the
expanded score, and the softmax-weighted latents times W_uv,h are its output. So every head attends one shared unit (a
grouped-query attention of one KV head), a row's columns are never expanded, and a query turned back by a held block's
offset turns its rope part alone, as for any partial rotary.

The rope key is stored in the order the model's cache holds it: DeepSeek V3's ``rope_interleave`` (LongCat's always)
turns the raw pairs (2i, 2i + 1) and writes evens then odds (rotate-half's layout), so the raw key is laid out that
way first (`rope_order`); DeepSeek V2's complex rotation keeps the raw interleaved pairs. LongCat scales its latent and
queries after their norms (`gains`).
"""

from __future__ import annotations

import torch

from .quantized import dense_weight


def gains(module, spec) -> tuple[float, float]:
    """What the module multiplies its latent and its queries by after their norms (1, 1 but for LongCat's)."""
    if spec.latent_gains is None:
        return 1.0, 1.0
    return tuple(float(getattr(module, name)) for name in spec.latent_gains)


def rope_order(config, spec) -> torch.Tensor | None:
    """The permutation of the raw rope channels into the layout the model's cache holds them in (None: as they are),
    as the family's description (``spec``, `families.Attention`) says."""
    if not (spec.rope_interleave is True or getattr(config, spec.rope_interleave, False)):
        return None
    r = config.qk_rope_head_dim
    return torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))


def laid_out(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Raw rope channels ``x`` [..., rope] in the cache's layout (`rope_order`)."""
    return x if order is None else x[..., order.to(x.device)]


def absorbed_query(module, query: torch.Tensor) -> torch.Tensor:
    """The query [B, H, T, nope + rope] the model hands its attention (rope part rotated), as one over the unit
    [rope key | latent]: [B, H, T, rope + latent], its nope part through the head's W_uk."""
    nope = module.qk_nope_head_dim
    q_nope, q_rope = query[..., :nope], query[..., nope:]
    return torch.cat((q_rope, torch.einsum("bhtn,hnc->bhtc", q_nope, key_up(module).to(query.dtype))), dim=-1)


def key_up(module) -> torch.Tensor:
    """W_uk [H, nope, latent]: each head's map from the latent to its key's nope channels."""
    return _up(module)[:, :module.qk_nope_head_dim]


def value_up(module) -> torch.Tensor:
    """W_uv [H, v_head_dim, latent]: each head's map from the latent to its value."""
    return _up(module)[:, module.qk_nope_head_dim:]


def _up(module) -> torch.Tensor:
    weight = dense_weight(module.kv_b_proj)  # [H * (nope + v), latent]; an FP8 checkpoint's times its scales
    return weight.view(module.num_heads, module.qk_nope_head_dim + module.v_head_dim, weight.shape[-1])


def values_out(module, latent_out: torch.Tensor) -> torch.Tensor:
    """The heads' attention output [B, H, T, v_head_dim] from their softmax-weighted latents [B, H, T, latent]."""
    return torch.einsum("bhtc,hvc->bhtv", latent_out, value_up(module).to(latent_out.dtype))


def unit_of(cached_latent: torch.Tensor, cached_rope: torch.Tensor) -> torch.Tensor:
    """What the model's own cache holds for a latent layer (keys: the latent; values: the rotated rope key, each
    [B, 1, T, ·]) as milo's unit [B, 1, T, rope + latent]."""
    return torch.cat((cached_rope, cached_latent), dim=-1)


def cache_pair(unit: torch.Tensor, latent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`unit_of`'s inverse: (latent, rope key) as the model's cache holds them."""
    return unit[..., -latent:], unit[..., :-latent]
