"""Text segments: the file round trip and its checks, and how an update plans them (kept, merged, split)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from milo_store import segments
from milo_store.errors import StoreCorruptedError


def test_a_segment_round_trips_and_refuses_a_damaged_header_or_array():
    arrays = segments.segment_arrays(["lost card", "über fee"], ["a", "b"], ["1", "2"], [0, 1, 2], [5, 6, 7])
    data, crc = segments.pack(arrays)
    seg = segments.Segment(np.frombuffer(data, dtype=np.uint8), crc, "s")
    assert seg.strings("input") == ["lost card", "über fee"] and seg.strings("id") == ["1", "2"]
    assert seg.array("token_ids").tolist() == [5, 6, 7] and seg.problems() == []
    for name, a in arrays.items():
        assert np.array_equal(seg.array(name), a) and seg.array(name).dtype == a.dtype.newbyteorder("<")
    with pytest.raises(StoreCorruptedError, match="header fails its checksum"):
        segments.Segment(np.frombuffer(data, dtype=np.uint8), crc ^ 1, "s")
    raw = bytearray(data)
    entry = seg.layout["input_bytes"]
    raw[seg.base + entry["offset"]] ^= 0x20
    damaged = segments.Segment(np.frombuffer(bytes(raw), dtype=np.uint8), crc, "s")
    with pytest.raises(StoreCorruptedError, match="input_bytes fails its checksum"):
        damaged.strings("input")
    assert damaged.strings("output") == ["a", "b"] and len(damaged.problems()) == 1


def test_an_append_joins_a_small_last_segment_and_a_removal_rewrites_only_its_own():
    per_block = [32] * 19  # 608 demonstrations: segments of at most 256
    previous = [8, 8, 3]  # blocks per previous segment: [0, 8) [8, 16) [16, 19), the last under half of 256
    everything = lambda k: [0, 8, 16][k]  # noqa: E731 (every block kept, none moved)
    assert segments.plan(previous, everything, per_block) == [("keep", 0), ("keep", 1), ("keep", 2)]
    appended = per_block + [32] * 3  # three blocks more: the small last segment joins them
    assert segments.plan(previous, everything, appended) == [("keep", 0), ("keep", 1), ("new", 16, 6)]
    changed = lambda k: None if k == 1 else [0, 8, 16][k]  # noqa: E731 (a block of segment 1 changed)
    assert segments.plan(previous, changed, per_block) == [("keep", 0), ("new", 8, 8), ("keep", 2)]
    dropped = lambda k: [0, None, 15][k]  # noqa: E731 (segment 1 lost a block: everything after moved down one)
    assert segments.plan(previous, dropped, per_block[:18]) == [("keep", 0), ("new", 8, 7), ("keep", 2)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.data())
def test_a_plan_covers_every_block_once_in_order_within_the_size(per_block, data):
    n = len(per_block)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=6)) if n > 1 else []))
    previous = np.diff([0, *cuts, n]).tolist()
    firsts = np.cumsum([0] + previous[:-1]).tolist()
    kept = set(data.draw(st.lists(st.sampled_from(range(len(previous))), max_size=len(previous))))
    plan = segments.plan(previous, lambda k: firsts[k] if k in kept else None, per_block)
    limit, at = segments.segment_demos(sum(per_block)), 0
    for item in plan:
        if item[0] == "keep":
            assert item[1] in kept and firsts[item[1]] == at
            at += previous[item[1]]
        else:
            _, first, count = item
            assert first == at and count >= 1 and (count == 1 or sum(per_block[first:first + count]) <= limit)
            at += count
    assert at == n
    kept_small = [k for k in kept if sum(per_block[firsts[k]:firsts[k] + previous[k]]) >= limit // 2]
    assert {item[1] for item in plan if item[0] == "keep"} >= {k for k in kept_small}
