"""Which store codec a store holds: by a mounted store's attributes (`open_codec`) or a build's codec name
(`for_config`). Every name not listed in `STORE_CODECS` is the low-rank codec's."""
from __future__ import annotations

from .bits import BitsCodec
from .lowrank import LowRankCodec

STORE_CODECS = {BitsCodec.name: BitsCodec}  # codecs with their own block format; every other name is low-rank


def open_codec(meta: dict, layout, dtype: str, ranks, tokens, read_array):
    """The codec of a mounted store (``read_array(name)``: a checked metadata array of the store)."""
    cls = STORE_CODECS.get(meta.get("codec"))
    if cls is None:
        return LowRankCodec(layout, dtype, ranks, tokens)
    return cls.open(meta, layout, ranks, tokens, read_array)


def for_config(codec: str):
    """The class whose ``plan_widths`` pass two runs for a build of ``codec`` (None: the low-rank codec's ranks)."""
    return STORE_CODECS.get(codec)
