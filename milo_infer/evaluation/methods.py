"""Method names of `milo eval` and `milo bench`: a name read into a store configuration.

A base — ``full`` (the uncompressed baseline: identity codec, fp16), ``raw`` (plain KV quantization),
``milo`` (SVD at ratio ρ, entropy allocation per head), the paper's two baselines at the same measured
bytes, ``global-proj`` (one corpus-wide projection per layer, K/V and head) and ``example-svd`` (every
demonstration factored alone) — then a quantization (``+int8``, ``+int4``, ``+kivi``) and modifiers
(``-fullrank`` keeps every direction, isolating the codec's rounding from the truncation; allocation
policy, scope, K/V split, ``-ks<share>``). ``bits`` is the bits codec (issue 45: per-block bases, one
code width per component), which takes only ``-ks<share>``. ``default`` is whatever `milo build` writes at the run's ratio.
``prefill`` is no store: the model prefills the demonstrations the ``full`` store retrieves (same
groups, same order) from their token ids, the plain-prompting baseline every store is measured against.
A store method may end in ``-recompute<n>``: the same store, each retrieved block's first n tokens
computed again by the model at query time (`Request.recompute`), e.g. ``default-recompute16``.
"""
from __future__ import annotations

import functools
import re

from milo_store import CompressionConfig

from ..building.config import PAPER_ALLOCATION, default_compression

# A method name is a base, a quantization, then modifiers: ``base(+quant)?(-modifier)*``, e.g.
# ``milo``, ``milo-energy``, ``milo+int8-ks0.3``, ``full+kivi``. Each part sets CompressionConfig
# fields; the ratio comes from the run unless the method fixes it (``full``, ``-fullrank``). One
# store has one name: modifiers come in the order below, at most one of each kind, and none that
# restates a default.
BASES = {
    "full": {"codec": "identity", "ratio": 1.0},  # the uncompressed baseline (identity codec)
    # plain KV quantization: every unit's K/V itself in the quantization's format (docs/format.md, raw
    # segments), no factors; its ratio is the format's (raw+int8 ~0.5, raw+int4 ~0.3, raw+kivi ~0.19)
    "raw": {"codec": "raw", "ratio": 1.0},
    "milo": {"codec": "svd"},
    # the paper's baselines at equal measured bytes (milo_store/codecs/baselines.py)
    "global-proj": {"codec": "global-proj"},
    "example-svd": {"codec": "example-svd"},
    "example-asvd": {"codec": "example-svd", "query_aware": True},  # activation-aware, as ASVD
    # each block's query-weighted SVD, one code width per component (milo_store/codecs/bits.py); it takes
    # no quantization and of the modifiers only -ks<share> (keys' share of the budget), -shared (one pool
    # for keys and values, both measured as the attention output's error over the assembled context) and
    # -ctx (every error measured so, each kind on its own share)
    "bits": {"codec": "bits", "query_aware": True},
}
OWN_WIDTHS = ("bits",)  # bases whose codec sets its own widths: no +quant, no allocation modifier but -ks
# KIVI-style groups (keys per channel in groups of 32 tokens, values per token). ``raw+kivi`` is KIVI's
# 2-bit quantization of the K/V (pre-RoPE); ``full+kivi`` the same grouping on an identity store's A = X,
# which also stores B = I per segment (d² bytes).
QUANTS = {"int8": "int8", "int4": "int4", "kivi": "int2"}
PLAIN_BASES = ("full", "raw")  # no allocation to modify: every unit is stored whole
MODIFIERS = {  # word -> (kind, fields); kinds in canonical order
    "fullrank": ("fullrank", {"full_rank": True, "ratio": 1.0}),  # every direction: the codec's rounding alone
    # entropy is the default; frontier chooses low rank or raw per unit (milo_store/codecs/allocation.py)
    **{p: ("policy", {"policy": p}) for p in ("energy", "uniform", "random", "frontier")},
    **{s: ("scope", {"scope": s}) for s in ("layer", "global")},  # head is the default
    "shared": ("split", {"kv_split": "shared"}),  # one budget for K and V instead of half each
    "ks": ("split", None),  # ks<share>: the keys' share of a separate budget, e.g. ks0.3
    "qaw": ("qaw", {"query_aware": True}),  # SVD of X diag(s): channels weighted by what their error costs
    "ctx": ("ctx", {"in_context": True}),  # bits: errors measured through attention over the assembled context
}
KINDS = list(dict.fromkeys(kind for kind, _ in MODIFIERS.values()))
EXAMPLES = ("full", "default", "bits", "raw+int8", "raw+kivi", "milo", "milo-fullrank", "milo-energy", "milo-layer",
            "milo-ks0.3", "milo+int8", "milo+int4", "milo+kivi", "milo+int8-qaw", "milo+int8-frontier-qaw",
            "global-proj", "example-svd", "example-asvd")
DEFAULT = "default"  # whatever `milo build` writes at the run's ratio (`default_method`)
PREFILL = "prefill"  # the model prefills full's retrieved demonstrations itself: full's store, no K/V read
RECOMPUTE = re.compile(r"(.+)-recompute(\d+)")  # a store method, then the tokens per block recomputed at query time


def split_recompute(name: str) -> tuple[str, int]:
    """The store method a name stands for and the tokens per block it recomputes at query time (0: none)."""
    matched = RECOMPUTE.fullmatch(name)
    if matched is None:
        return name, 0
    base, n = matched.group(1), int(matched.group(2))
    if base == PREFILL:
        raise ValueError(f"method {name!r}: prefill computes every token already; -recompute<n> follows a store method")
    if n == 0 or str(n) != matched.group(2):
        raise ValueError(f"method {name!r}: write -recompute<n> with n of 1 or more tokens, no leading zeros")
    return base, n


def recompute_name(method: str, n: int) -> str:
    """``method`` recomputing ``n`` tokens per block (itself when n is 0): the inverse of `split_recompute`."""
    return f"{method}-recompute{n}" if n else method


@functools.cache
def method_fields(name: str) -> dict:
    """The CompressionConfig fields a method name stands for (ValueError naming the bad part)."""
    name = split_recompute(name)[0]  # the store does not depend on what a query recomputes
    if name == PREFILL:  # retrieves from full's store
        return dict(BASES["full"])
    base = max((b for b in BASES if name == b or name.startswith((b + "-", b + "+"))), key=len, default=None)
    if base is None:
        raise ValueError(f"unknown method {name!r}: it must start with one of {', '.join(BASES)}")
    fields, rest = dict(BASES[base]), name[len(base):]
    parts = re.findall(r"([+-])([^+-]+)", rest)
    if "".join(sign + word for sign, word in parts) != rest:
        raise ValueError(f"unknown method {name!r}: cannot read {rest!r}")
    quant, mods = [w for sign, w in parts if sign == "+"], [w for sign, w in parts if sign == "-"]
    if len(quant) > 1:
        raise ValueError(f"unknown method {name!r}: one quantization per method")
    if quant and quant[0] not in QUANTS:
        raise ValueError(f"unknown method {name!r}: +{quant[0]} is not a quantization ({', '.join(QUANTS)})")
    if base in OWN_WIDTHS and (quant or any(not w.startswith("ks") and w not in ("shared", "ctx") for w in mods)):
        raise ValueError(f"method {name!r}: {base} chooses its own code widths; it takes only -ks<share>, -shared or -ctx")
    if quant:
        fields["dtype"] = QUANTS[quant[0]]
    kinds = []
    for word in mods:
        share = re.fullmatch(r"ks(0\.\d*[1-9])", word)
        if base in PLAIN_BASES or (word not in MODIFIERS and not share) or word == "ks":
            raise ValueError(f"unknown method {name!r}: -{word} is not a modifier of {base}"
                             + ("" if base in PLAIN_BASES else f" (known: {', '.join(w for w in MODIFIERS if w != 'ks')}, ks<share>)"))
        kind, extra = MODIFIERS["ks" if share else word]
        fields.update(extra or {"key_share": float(share.group(1))})
        kinds.append(kind)
    canonical = base + "".join("+" + q for q in quant) + "".join(
        "-" + w for w in sorted(mods, key=lambda w: KINDS.index(MODIFIERS["ks" if w.startswith("ks") else w][0])))
    if len(set(kinds)) < len(kinds) or canonical != name:
        raise ValueError(f"method {name!r}: write it as {canonical!r} (one name per store)" if canonical != name else
                         f"method {name!r}: at most one modifier of each kind ({', '.join(KINDS)})")
    return fields


def default_method(ratio: float) -> str:
    """The method name of what `milo build` writes by default at ``ratio`` (dtype, allocation, weighting)."""
    c = default_compression(ratio)
    if c.codec in OWN_WIDTHS:
        return c.codec + (f"-ks{c.key_share:g}" if c.key_share != 0.5 else "")
    quant = {dtype: word for word, dtype in QUANTS.items()}[c.dtype]
    # policy, scope and split away from the paper's (the names' defaults), in the canonical order; their
    # values are the modifier words
    modifiers = [getattr(c, field) for field, paper in PAPER_ALLOCATION.items() if getattr(c, field) != paper]
    return f"milo+{quant}" + "".join(f"-{m}" for m in modifiers) + "-qaw"


def resolve(method: str, ratio: float) -> str:
    """The concrete method a name stands for at ``ratio``: ``default`` becomes `default_method`."""
    base, n = split_recompute(method)
    return recompute_name(default_method(ratio) if base == DEFAULT else base, n)


def method_config(name: str, ratio: float, seed: int = 0) -> CompressionConfig:
    """The store configuration a method name stands for (fp16 factors unless the method quantizes)."""
    return CompressionConfig(**{"ratio": ratio, "seed": seed, "dtype": "float16",
                                **method_fields(resolve(name, ratio))})


def fixed_ratio(method: str) -> bool:
    """Whether the method's store is the same at every ratio (full, raw, -fullrank)."""
    method = split_recompute(method)[0]
    return method != DEFAULT and "ratio" in method_fields(method)


def store_name(method: str, ratio: float) -> str:
    """Directory name of a method's store: the ratio is part of it only where it changes the store.
    ``default`` shares the store of the method it stands for, ``prefill`` full's, ``-recompute<n>`` its base's."""
    method = split_recompute(method)[0]
    method = "full" if method == PREFILL else resolve(method, ratio)
    return method if fixed_ratio(method) else f"{method}-r{ratio:g}"
