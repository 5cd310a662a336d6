"""Pass two's writing: the store a build planned (`codecs.plan_store`), written block by block.

The codec room plans (the source of every block, its ranks or widths, the codec that encodes it);
this module writes its blocks, the demonstrations' text and the index through `StoreWriter`, keeping
an update's reused blocks in place or copying them from the previous version.
"""
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import segments, text_index
from .codecs import CompressionConfig, allocation_record, demonstration_blocks, plan_store, quant_layout
from .layout import Layout
from .staging import Staging
from .store import MiloStore
from .writer import StoreWriter


READ_AHEAD_BYTES = 64 << 20  # kept blocks read from the previous version at once (one round of GETs from a URL)


def _read_ahead(previous: MiloStore, reused: dict[int, int], first: int, copied) -> dict[int, torch.Tensor]:
    """The kept blocks to copy (``copied(previous block)``) from ``first`` on, while they run on, up to
    READ_AHEAD_BYTES, read in one batch."""
    run, size = [], 0
    while first + len(run) in reused and copied(reused[first + len(run)]) and (not run or size < READ_AHEAD_BYTES):
        run.append(first + len(run))
        size += int(previous.block_bytes([reused[run[-1]]])[0])
    return dict(zip(run, previous.stored_blocks([reused[i] for i in run])))


def write_store(path, staging: Staging, num_blocks: int, layout: Layout, config: CompressionConfig, *,
                attrs: dict | None = None, anchor_kv: torch.Tensor | None = None, examples: dict | None = None,
                token_ids: np.ndarray | None = None, channel_scale: torch.Tensor | None = None,
                key_gain: torch.Tensor | None = None, anchor_states: dict | None = None, force: bool = False,
                lock=None, progress: Callable[[str, int, int], None] | None = None,
                previous: MiloStore | None = None, reused: dict[int, int] | None = None,
                purge: set[int] | None = None, value_attention=None) -> Path:
    """Allocate and commit the store at ``path`` from ``num_blocks`` staged blocks.

    ``progress(stage, done, total)`` is told how far each stage is: ``allocating`` (every staged
    block read, then the allocation) and ``writing`` (every block packed and written, then the
    demonstrations, index and commit), so a caller can show the seconds they take.

    ``examples`` holds lists ``input``, ``output``, ``id``, ``block`` (the staged block of each
    demonstration) and, for ``example-svd``, ``tokens`` (each one's token count).
    In such a store a demonstration's ``block`` is its own store block and ``block_group`` names the
    staged one. ``channel_scale`` is a query-aware store's (see `codecs.planning.pass_two_source`); ``key_gain``
    [L, d] the K = V layers' gains, which a layout holding such layers keeps beside the anchor, and ``anchor_states``
    each linear layer's state over the anchor (`StoreWriter.write_anchor`).

    An update names the store version it replaces (``previous``, the one at ``path``) and ``reused``
    {block: block of the previous version whose bytes it keeps}: those blocks keep their ranks and
    bytes, and only the others, staged under their own index, are allocated (together, at
    ``config.ratio``: the kept ones' ranks cannot change without changing their bytes) and packed.
    Kept blocks stay in the previous version's chunks, except those sharing a chunk with a block of
    ``purge`` (the previous blocks whose bytes must leave: K/V computed from a removed demonstration;
    default, every block not kept), which are written again (`StoreWriter`). ``value_attention(i, keys)``:
    calibration attention over block i's pre-RoPE keys, which a codec that measures values' errors
    through attention takes (`codecs.bits`; the low-rank codec ignores it). Text segments whose blocks
    are all kept are the previous version's (`segments.plan`); the corpus-wide vocabulary is built anew.
    """
    layout = quant_layout(layout, config.dtype)
    reused = dict(reused or {})
    if previous is not None and purge is None:
        purge = set(range(previous.num_blocks)) - set(reused.values())
    progress = progress or (lambda stage, done, total: None)
    source, codec = plan_store(staging, num_blocks, layout, config, examples=examples, channel_scale=channel_scale,
                               previous=previous, reused=reused, value_attention=value_attention,
                               read=lambda done, total: progress("allocating", done, total + 1))
    ranks, tokens = codec.ranks, codec.tokens
    encoded = sum(i not in reused for i in range(source.num_blocks))
    progress("allocating", encoded + 1, encoded + 1)
    attrs = {**(attrs or {}), "codec": config.codec, "allocation": allocation_record(config)}
    with StoreWriter(path, layout, ranks, tokens, dtype=config.dtype, attrs=attrs, force=force, lock=lock,
                     block_group=source.block_group, previous=previous, purge=purge or (), codec=codec) as w:
        copied = lambda j: not w.can_keep(j)  # noqa: E731
        ahead: dict[int, torch.Tensor] = {}
        for i in range(source.num_blocks):
            if i in reused and w.can_keep(reused[i]):
                w.keep_block(reused[i])
            elif i in reused:
                ahead = ahead or _read_ahead(previous, reused, i, copied)
                w.write_block(ahead.pop(i))
            else:
                w.write_block(codec.encode(i, source.factors(i)))
            progress("writing", i + 1, source.num_blocks + 1)
        if anchor_kv is not None:
            w.write_anchor(anchor_kv, key_gain, anchor_states)
        if examples is not None or token_ids is not None:
            write_text(w, examples or {}, demonstration_blocks(source, examples), token_ids, tokens, previous, reused)
        committed = w.commit()
    progress("writing", source.num_blocks + 1, source.num_blocks + 1)
    return committed


def write_text(w: StoreWriter, examples: dict, example_block, token_ids, block_tokens: np.ndarray,
               previous: MiloStore | None, reused: dict[int, int]) -> None:
    """The version's text: its demonstrations (in block order), token ids and BM25 postings in segments
    (the previous version's where their blocks are all kept with the same text, new ones elsewhere), and the
    corpus-wide vocabulary of the BM25 index."""
    text = segments.VersionText(examples, example_block, token_ids, block_tokens)
    previous_blocks, kept_at = [], lambda k: None  # noqa: E731
    if previous is not None and previous.segmented:
        previous_blocks = previous.segment_table[:, 2].tolist()
        new_of = {j: i for i, j in reused.items()}

        def kept_at(k: int) -> int | None:
            _, first, count, _, _ = previous.segment_table[k].tolist()
            at = new_of.get(first)
            if at is None or any(reused.get(at + t) != first + t for t in range(count)):
                return None
            return at if text.holds(previous.segment(k), at, count) else None

    for item in segments.plan(previous_blocks, kept_at, np.diff(text.block_starts).tolist()):
        if item[0] == "keep":
            w.keep_segment(item[1])
        else:
            w.write_segment(item[2], text.segment_arrays(item[1], item[2]))
    if text.demos["input"]:  # the retrieval index's corpus-wide part, built here rather than at every mount
        arrays, attrs = text_index.vocabulary(text.demos["input"])
        w.write_index(text_index.NAME, arrays, attrs)
