"""`PrefixRebuild` limited to a `KVShare` (one worker's layers and KV heads) against the whole rebuild.

A tensor-parallel or pipeline-parallel worker's cache holds only its heads or its layers: what it
rebuilds must be exactly that slice of the whole prefix, from every tier and every factor encoding.
"""
import os

import pytest
import torch

from milo_infer.bench import synthetic_model
from milo_infer.models import layer_rope_tables
from milo_infer.runtime.prefix import KVShare, PrefixRebuild, StorePrefix, carried
from milo_kernels import reconstruct_layer
from milo_store import CompressionConfig, MiloStore

ROWS = [[0, 2], [2, 1, 3]]  # two rows sharing block 2, of different lengths


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.manual_seed(0)
    loaded = synthetic_model.random_model("tiny")  # 2 layers, 2 KV heads
    paths = synthetic_model.synthetic_stores(tmp_path_factory.mktemp("share"), loaded, demos=32, block_size=8,
                                             demo_tokens=5, ratios=(0.5, 0.25))
    return paths, layer_rope_tables(loaded.model, 512)


def rebuilt(store: MiloStore, rope, share: KVShare | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's prefix, [rows, layers, heads, T, d] for K and V, as far as ``share`` reaches."""
    prefix = StorePrefix("s", store, rope, "cpu", torch.float32)
    rows = [prefix.place(blocks) for blocks in ROWS]
    rebuild = PrefixRebuild(rows, rope, "cpu", share=share)
    layers, heads = rebuild.share.layers, rebuild.heads(rebuild.share.layers[0])  # every layer alike here
    T = max(row.prefix_tokens for row in rows)
    k = torch.zeros(len(rows), len(layers), len(heads), T, store.layout.head_dim)
    v = torch.zeros_like(k)
    for i, layer in enumerate(layers):
        rebuild.fill(layer, k[:, i], v[:, i])
    return k, v


@pytest.mark.parametrize("tier", ["host", "disk", "cached"])
@pytest.mark.parametrize("name", ["full", "milo-r0.5", "milo-r0.25"])
def test_a_share_rebuilds_exactly_its_slice_of_the_whole(built, name, tier):
    paths, rope = built
    with MiloStore.open(paths[name], tier=tier) as store:
        whole_k, whole_v = rebuilt(store, rope, None)
        for layers, heads in ((range(1, 2), range(1, 2)), (range(0, 1), range(0, 2)), (range(0, 2), range(0, 1))):
            k, v = rebuilt(store, rope, KVShare(layers, heads))
            want = (slice(None), slice(layers.start, layers.stop), slice(heads.start, heads.stop))
            assert torch.equal(k, whole_k[want]) and torch.equal(v, whole_v[want]), (layers, heads)


def test_a_share_refuses_layers_and_heads_it_does_not_hold(built):
    paths, rope = built
    with MiloStore.open(paths["full"]) as store:
        prefix = StorePrefix("s", store, rope, "cpu", torch.float32)
        rebuild = PrefixRebuild([prefix.place([0])], rope, "cpu", share=KVShare(range(1, 2), range(0, 1)))
        k = torch.zeros(1, 1, rebuild.rows[0].prefix_tokens, store.layout.head_dim)
        with pytest.raises(ValueError, match="not in this rebuild's layers"):
            rebuild.fill(0, k, k.clone())
        for share in (KVShare(range(0, 3), range(0, 1)), KVShare(range(0, 1), range(1, 3)), KVShare(range(0, 0), range(0, 1))):
            with pytest.raises(ValueError, match="is not a run of the layout"):
                PrefixRebuild([prefix.place([0])], rope, "cpu", share=share)


def test_a_window_layer_reaches_the_blocks_with_a_token_inside_its_window():
    """Blocks at [4, 14), [14, 24), [24, 34); the query's first token at 34: a window of 10 sees 25..34 (the last
    block only), one of 11 sees 24 (the last block's first token), one of 12 sees 23 (the middle block's last),
    one of 21 sees 14 on, one of 22 sees 13 (the first block's last)."""
    import numpy as np

    from milo_infer.runtime.prefix import BlockPlacement

    placement = BlockPlacement("s", [7, 3, 5], np.array([4, 14, 24]), np.zeros(0), 34, 0, 0)
    assert placement.reached_by_windows(34, [None, 10, 11, 12, 21, 22]) == [
        [0, 1, 2], [2], [2], [1, 2], [1, 2], [0, 1, 2]]


SHARING = [[0, 2], [2, 1, 3], [0, 2, 3], [], [3, 1]]  # block 2 at the same and at other positions; an anchor-only row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["full", "milo-r0.5", "milo-r0.25"])
def test_rows_sharing_blocks_rebuild_as_each_alone_through_the_kernel(built, name, dtype):
    """The CPU's rebuild decodes a block several rows place once and rotates it per position: every row must be
    what the kernels' rebuild writes for that row alone, to the bit."""
    paths, rope = built
    with MiloStore.open(paths[name]) as store:
        prefix = StorePrefix("s", store, rope, "cpu", dtype)
        rows = [prefix.place(blocks) for blocks in SHARING] + [prefix.nothing_placed()]
        shared = PrefixRebuild(rows, rope, "cpu")
        T, (H, d) = max(row.prefix_tokens for row in rows), (store.layout.num_kv_heads, store.layout.head_dim)
        (tables, _, placed), = shared.shared.values()  # 4 blocks decoded, some placed twice at one position
        assert tables[0].shape[0] == 4 * 2 * H and len(placed) > 4 and max(map(len, placed.values())) > 1
        for layer in range(store.layout.num_layers):
            k, v = torch.zeros(len(rows), H, T, d, dtype=dtype), torch.zeros(len(rows), H, T, d, dtype=dtype)
            shared.fill(layer, k, v)
            for r, row in enumerate(rows):  # alone, through reconstruct_layer (not the default function: per row)
                alone = PrefixRebuild([row], rope, "cpu", rebuild=lambda *a, **kw: reconstruct_layer(*a, **kw))
                want_k, want_v = torch.zeros(1, H, T, d, dtype=dtype), torch.zeros(1, H, T, d, dtype=dtype)
                alone.fill(layer, want_k, want_v)
                assert torch.equal(k[r], want_k[0]) and torch.equal(v[r], want_v[0]), (name, layer, SHARING[r:r + 1])


INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@pytest.fixture(scope="module")
def bits_built(tmp_path_factory):
    torch.manual_seed(0)
    loaded = synthetic_model.random_model("tiny")  # 2 layers, 2 KV heads
    paths = synthetic_model.synthetic_stores(tmp_path_factory.mktemp("bits"), loaded, demos=24, block_size=8,
                                             demo_tokens=5, ratios=(), bits_ratios=(0.2,))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the engine keeps its tables on its device
    return paths["bits-r0.2"], layer_rope_tables(loaded.model, 512, device=device)


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET and os.environ.get("MILO_KERNEL") == "triton"),
                    reason="needs CUDA, or MILO_KERNEL=triton with TRITON_INTERPRET=1")
def test_a_bits_store_rebuilds_from_its_codes_as_from_its_decoded_factors(bits_built):
    """Where the Triton kernel rebuilds, a bits store's blocks are staged as their stored bytes and rebuilt from the
    codes (`staged_codes`): every row, whole and in a share of heads, as the decoded factors rebuild it (the kernels'
    reference on the host), and the bytes moved are the stored ones."""
    from milo_infer.runtime.prefix import rebuild_layer
    from milo_infer.runtime.staged_codes import StagedCodes

    path, rope = bits_built
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with MiloStore.open(path) as store:
        prefix = StorePrefix("s", store, rope, device, torch.float32)
        rows = [prefix.place(blocks) for blocks in [[0, 2], [2, 1], [1]]] + [prefix.nothing_placed()]
        T, (H, d) = max(row.prefix_tokens for row in rows), (store.layout.num_kv_heads, store.layout.head_dim)
        for share in (None, KVShare(range(0, 2), range(1, 2))):
            codes = PrefixRebuild(rows, rope, device, share=share)
            assert rebuild_layer is codes.rebuild and set(codes.fetched) == set() and isinstance(codes.codes[prefix], StagedCodes)
            assert codes.fetch_stats["bytes"] == int(store.block_bytes([0, 2, 1]).sum())
            reference = PrefixRebuild(rows, rope, device, share=share,
                                      rebuild=lambda *a, **kw: reconstruct_layer(*a, **kw, backend="reference"))
            heads = codes.heads(0)  # every layer alike here
            for layer in range(store.layout.num_layers):
                got = [torch.full((len(rows), len(heads), T, d), float("nan"), device=device) for _ in range(2)]
                want = [g.clone() for g in got]
                codes.fill(layer, *got)
                reference.fill(layer, *want)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g.cpu(), w.cpu(), rtol=2e-3, atol=2e-3 * float(w.nan_to_num().abs().max()),
                                               equal_nan=True)


@pytest.fixture(scope="module")
def gemma4_store(tmp_path_factory):
    """An INT8 store of Gemma 4's tiny model (`tests/infer/families.py`) and its RoPE tables on the device."""
    from milo_infer.building.builder import build_store
    from milo_infer.building.config import BuildConfig
    from milo_store import CompressionConfig
    from tests.infer import families

    path = tmp_path_factory.mktemp("gemma4") / "s"
    loaded = families.tiny_model("gemma4_text")
    config = BuildConfig(block_size=2, compression=CompressionConfig(ratio=0.5, dtype="int8"))
    build_store(path, loaded, families.demonstrations(8), families.TASK, config, progress=False)
    return path, layer_rope_tables(loaded.model, 512, device="cuda" if torch.cuda.is_available() else "cpu")


def layer_by_layer(rebuild: PrefixRebuild, layers, device):
    """Every layer holding K/V of every row, rebuilt: {layer: (k, v)} of [rows, heads, T, d] fp32."""
    T = max(row.prefix_tokens for row in rebuild.rows)
    out = {}
    for layer, spec in enumerate(layers):
        if spec.holds_cache:
            out[layer] = [torch.zeros(len(rebuild.rows), spec.kv_heads, T, spec.head_dim, device=device)
                          for _ in range(2)]
            rebuild.fill(layer, *out[layer])
    return out


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRET, reason="the host's decode-once path")
def test_keys_from_values_rebuilt_per_row_equal_the_decode_once_path(gemma4_store):
    """A K = V layer's keys, rebuilt row by row (`PrefixRebuild._keys_from_values`: the kernels' path) and decoded once
    for every row (the host's path, which the conformance suite holds to the model): the same."""
    path, rope = gemma4_store
    with MiloStore.open(path) as store:
        prefix = StorePrefix("s", store, rope, "cpu", torch.float32)
        rows = [prefix.place([0, 2]), prefix.place([3, 1, 2])]
        once = PrefixRebuild(rows, rope, "cpu")
        per_row = PrefixRebuild(rows, rope, "cpu", rebuild=lambda *a, **kw: reconstruct_layer(*a, **kw))
        assert once.shared is not None and per_row.shared is None and 1 in prefix.key_gain
        got, want = (layer_by_layer(r, store.layout.layers, "cpu") for r in (per_row, once))
        for layer in want:
            for g, w in zip(got[layer], want[layer]):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6 * float(w.abs().max()))


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET and os.environ.get("MILO_KERNEL") == "triton"),
                    reason="needs CUDA, or MILO_KERNEL=triton with TRITON_INTERPRET=1")
def test_layers_of_other_shapes_rebuild_through_the_kernel_as_on_the_host(gemma4_store):
    """Gemma 4's layers (sliding ones of 2 heads of 16, full ones of 1 of 32 whose keys are their values times a gain,
    shared ones holding nothing), a window's reach per layer: the Triton kernel, planned once per shape of segment
    table, writes every layer as the kernels' reference does."""
    from milo_infer.runtime.prefix import rebuild_layer

    path, rope = gemma4_store
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with MiloStore.open(path) as store:
        prefix = StorePrefix("s", store, rope, device, torch.float32)
        windows = [8 if spec.head_dim == 16 else None for spec in store.layout.layers]
        rows = [prefix.place([0, 2]), prefix.place([3, 1, 2]).windowed(30, windows)]
        kernel = PrefixRebuild(rows, rope, device)
        reference = PrefixRebuild(rows, rope, device,
                                  rebuild=lambda *a, **kw: reconstruct_layer(*a, **kw, backend="reference"))
        assert kernel.rebuild is rebuild_layer and reference.shared is None
        got, want = (layer_by_layer(r, store.layout.layers, device) for r in (kernel, reference))
        for layer in want:
            for g, w in zip(got[layer], want[layer]):  # INT8 in the kernel's fp16 products, as the bits test above
                torch.testing.assert_close(g.cpu(), w.cpu(), rtol=2e-3, atol=2e-3 * float(w.abs().max()))


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRET, reason="runs in this process")
def test_the_kernel_paths_under_the_interpreter():
    """The two tests above that need the Triton kernel, in a process of their own under its interpreter."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                             "from_its_codes or through_the_kernel_as_on_the_host", __file__],
                            cwd=repo, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1", "MILO_KERNEL": "triton", "PYTHONPATH": str(repo)})
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


def test_a_rows_linear_state_is_the_anchors_carried_through_its_blocks_pairs_in_order(tmp_path, built):
    """`PrefixRebuild.linear_states`: per row, M_last (... (M_first C_anchor + C_first) ...) + C_last over the blocks
    in the row's order, and the last block's conv tail (the anchor's with none), read from the store's sections: a
    row placing the same blocks in the other order gets another state."""
    from unittest import mock

    from milo_store import Layout, synthetic
    from milo_store.layers import ATTENTION, LINEAR, LayerSpec

    layers = [LayerSpec(LINEAR, 2, 4, value_dim=3, conv_dim=8, conv_kernel=4), LayerSpec(ATTENTION, 2, 16)]
    drawn, real = [], synthetic.synthetic_states
    with mock.patch.object(synthetic, "synthetic_states", lambda *a: drawn.append(real(*a)) or drawn[-1]):
        synthetic.build_synthetic_store(tmp_path / "s", Layout.of(layers), [24, 30, 20], CompressionConfig(
            dtype="float32"))
    layout, (anchor, blocks) = Layout.of(layers), (drawn[-1][0], [d[0] for d in drawn[:-1]])
    with MiloStore.open(tmp_path / "s") as store:
        prefix = StorePrefix("s", store, built[1], "cpu", torch.float32)
        rows = [prefix.place([2, 0]), prefix.place([0, 2]), prefix.place([]), prefix.nothing_placed()]
        states = PrefixRebuild(rows, built[1], "cpu").linear_states(0)
    part = {name: [layout.state_section(0, x)[name] for x in blocks] for name in ("M", "C", "conv")}
    start = layout.state_section(0, anchor)
    for (state, window), order in zip(((s.state, s.window) for s in states[:2]), ([2, 0], [0, 2])):
        expected = start["C"]
        for b in order:
            expected = part["M"][b] @ expected + part["C"][b]
        torch.testing.assert_close(state, expected)
        torch.testing.assert_close(window, part["conv"][order[-1]])
    assert (states[0].state - states[1].state).abs().max() > 1e-3
    torch.testing.assert_close(states[2].state, start["C"])
    torch.testing.assert_close(states[2].window, start["conv"])
    assert states[3] is None  # no prefix at all: the row starts from zero


def test_unreadable_blocks_split_a_rows_composition_into_joins_at_their_ends(tmp_path, built):
    """Every subset of three placed blocks left unread: the start carries the anchor through the blocks before the
    first unread one; each run of read blocks after unread ones is a `Join` at the unread tokens fed before it, whose
    pair moves any state as those blocks' pairs one after another do, its window the run's last tail."""
    import itertools

    from milo_store import Layout, synthetic
    from milo_store.layers import ATTENTION, LINEAR, LayerSpec

    layers = [LayerSpec(LINEAR, 2, 4, value_dim=3, conv_dim=8, conv_kernel=4), LayerSpec(ATTENTION, 2, 16)]
    synthetic.build_synthetic_store(tmp_path / "s", Layout.of(layers), [24, 30, 20], CompressionConfig(
        dtype="float32"))
    with MiloStore.open(tmp_path / "s") as store:
        prefix = StorePrefix("s", store, built[1], "cpu", torch.float32)
        order, tokens = [2, 0, 1], store.block_tokens
        unread_sets = [set(u) for n in range(4) for u in itertools.combinations(order, n)]
        rows = [prefix.place(order, unread=frozenset(u)) for u in unread_sets]
        starts = PrefixRebuild(rows, built[1], "cpu").linear_states(0)
        sections = {b: store.layout.block_states(store.ranks[b], int(tokens[b]), store.block(b))[0] for b in order}
    anchor = prefix.anchor_state[0]
    probe = torch.randn_like(anchor[0])
    for unread, start in zip(unread_sets, starts):
        runs, fed, gap = [[0, []]], 0, False  # each run of read blocks: the unread tokens fed before it, its blocks
        for b in order:
            if b in unread:
                fed, gap = fed + int(tokens[b]), True
                continue
            if gap:
                runs.append([fed, []])
                gap = False
            runs[-1][1].append(b)
        state, window = anchor
        for b in runs[0][1]:
            state, window = carried(sections[b], state), sections[b]["conv"]
        torch.testing.assert_close(start.state, state)
        torch.testing.assert_close(start.window, window)
        assert [join.at for join in start.joins] == [at for at, _ in runs[1:]], unread
        for join, (_, blocks) in zip(start.joins, runs[1:]):
            expected = probe
            for b in blocks:
                expected = carried(sections[b], expected)
            moved, tail = join.apply(probe, window)
            torch.testing.assert_close(moved, expected)
            torch.testing.assert_close(tail, sections[blocks[-1]]["conv"])
