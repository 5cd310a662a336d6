import torch
from hypothesis import given, settings, strategies as st

from milo_store import CompressionConfig, Layout, MiloStore
from milo_store.codecs.lowrank_reference import reconstruct
from milo_kernels import dequantize_int8_segment
from milo_store.codecs.quant import pack_segment
from milo_store.synthetic import build_synthetic_store


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 90), st.sampled_from([8, 16, 64]), st.integers(0, 64), st.integers(0, 2**16))
def test_int8_segment_roundtrip_error_is_small_and_size_exact(T, d, r, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g) * 5
    U, S, Vh = torch.linalg.svd(x, full_matrices=False)
    r = min(r, S.numel())
    raw = pack_segment(U[:, :r], S[:r], Vh[:r].T)
    # docs/format.md: r (T' + d + 10) bytes, T' = T rounded up to even
    assert raw.dtype == torch.uint8 and raw.numel() == r * (T + T % 2 + d + 10)
    assert raw.numel() % 2 == 0  # fp16 headers of the next segment stay aligned
    if r == 0:
        return
    A, S2, B = dequantize_int8_segment(raw, r, T, d)  # the kernels' reader agrees with the store's writer
    exact = reconstruct(U[:, :r], S[:r], Vh[:r].T)
    err = (reconstruct(A, S2, B) - exact).norm() / exact.norm().clamp_min(1e-6)
    assert err < 0.03  # 8-bit codes per column: well under the truncation errors that matter


def test_int8_store_meets_ratio_and_holds_more_rank(tmp_path):
    layout = Layout(2, 2, 32)
    tokens = [90, 120, 70]
    fp16 = MiloStore.open(build_synthetic_store(tmp_path / "f", layout, tokens, CompressionConfig(ratio=0.5)))
    int8 = MiloStore.open(build_synthetic_store(tmp_path / "q", layout, tokens, CompressionConfig(ratio=0.5, dtype="int8")))
    assert int8.layout.quantized and int8.dtype == "int8" and int8.verify_all() == []
    acc = int8.accounting()
    assert acc["ratio"] <= 0.5 and abs(acc["ratio"] - 0.5) < 0.02
    assert int8.ranks.mean() > 1.6 * fp16.ranks.mean()
    assert int8.anchor_kv().dtype == torch.float16


def test_int8_store_from_before_int4_still_opens(tmp_path):
    """Layouts written before INT4 say only ``quantized: true``; they read as INT8."""
    import zarr
    path = build_synthetic_store(tmp_path / "q", Layout(2, 2, 32), [40, 33], CompressionConfig(ratio=0.5, dtype="int8"))
    group = zarr.open_group(str(path), mode="r+")
    meta = dict(group.attrs["milo"])
    assert meta["layout"]["quant"] == "int8" and meta["layout"]["quantized"] is True
    meta["layout"] = {k: v for k, v in meta["layout"].items() if k != "quant"}
    group.attrs["milo"] = meta
    with MiloStore.open(path) as store:
        assert store.layout.quant == "int8" and store.verify_all() == []


def test_quant_error_tool_orders_the_groupings_by_bits(tmp_path):
    """tools/quant_error.py on a synthetic staged block: fewer bits, more error; finer groups, less."""
    import sys
    from pathlib import Path
    from safetensors.torch import save_file
    from milo_store import factorize_block
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
    from quant_error import errors
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 300, 16, generator=g), torch.randn(2, 2, 300, 16, generator=g)
    f = factorize_block(k, v, codec="svd")
    save_file({"A": f.A.contiguous(), "S": f.S.contiguous(), "B": f.B.contiguous()}, tmp_path / "b.safetensors")
    e = errors(str(tmp_path / "b.safetensors"), [0, 1])
    int8, int4, int4_32, int2_32 = (e[n] for n in ("int8, one scale per column", "int4, one scale per column",
                                                    "int4, per column, spans of 32 tokens (keys)",
                                                    "int2, per column, spans of 32 tokens (keys)"))
    for kind in (0, 1):
        assert int8[kind] < int4_32[kind] < int4[kind] and int4_32[kind] < int2_32[kind]
