"""reconstruct_layer: the reference against dense ground truth, input validation, backend dispatch.

The kernel-vs-reference tests live in test_reconstruct_triton.py; on a machine without CUDA the last
test here runs that module in a subprocess under the Triton interpreter.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowrank_cases import (check_outputs, nan_buffers, random_layer, rope_by_complex, rope_tables,
                           run_under_interpreter, target_mask)
from milo_kernels import kernel_backend, reconstruct as rk, reconstruct_layer, reconstruct_layer_naive

REPO = Path(__file__).resolve().parents[2]


def pack_svd(matrices, d, rank=None):
    """SVD-factor each dense [T, d] matrix (truncated to `rank`) and pack them back to back."""
    parts, meta, offset = [], [], 0
    for x in matrices:
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        r = s.numel() if rank is None else rank
        parts += [u[:, :r].flatten(), s[:r], vh[:r].T.flatten()]
        meta.append((offset, r))
        offset += r * (x.shape[0] + d + 1)
    return torch.cat(parts), meta


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("tokens", [5, 40, 200], ids=lambda t: f"T{t}")
def test_full_rank_reference_recovers_rotated_keys_and_plain_values(tokens, interleaved):
    torch.manual_seed(tokens)
    d, kv_heads, first = 64, 2, 3
    dense = {(kind, head): torch.randn(tokens, d, dtype=torch.float64) for kind in (0, 1) for head in range(kv_heads)}
    factors, meta = pack_svd(dense.values(), d)
    segments = torch.tensor([[off, r, tokens, first, head, kind] for (off, r), (kind, head) in zip(meta, dense)])
    n_rows = first + tokens + 4
    cos, sin = rope_tables(n_rows, d, interleaved)
    out_k = torch.full((kv_heads, n_rows, d), math.nan, dtype=torch.float32)
    out_v = out_k.clone()
    reconstruct_layer(factors.float(), segments, out_k, out_v, cos, sin, interleaved=interleaved)
    for (kind, head), x in dense.items():
        want = rope_by_complex(x, first, interleaved) if kind == 0 else x
        got = (out_k if kind == 0 else out_v)[head]
        torch.testing.assert_close(got[first:first + tokens].double(), want, atol=1e-4, rtol=1e-4)
        assert got[:first].isnan().all() and got[first + tokens:].isnan().all()


def test_truncated_rank_error_is_the_discarded_spectrum():
    """Eckart–Young: the rank-r reconstruction misses exactly the trailing singular values."""
    torch.manual_seed(0)
    d, tokens, rank = 64, 90, 11
    x = torch.randn(tokens, d, dtype=torch.float64)
    factors, meta = pack_svd([x], d, rank=rank)
    segments = torch.tensor([[meta[0][0], rank, tokens, 0, 0, 1]])
    out_k, out_v = torch.zeros(2, 1, tokens, d, dtype=torch.float64).unbind(0)
    cos, sin = rope_tables(tokens, d, interleaved=False)
    reconstruct_layer_naive(factors, segments, out_k, out_v, cos, sin)
    tail = torch.linalg.svdvals(x)[rank:]
    assert math.isclose(torch.linalg.norm(out_v[0] - x), tail.norm().item(), rel_tol=1e-9)


def test_rank_zero_writes_zeros():
    d = 64
    segments = torch.tensor([[0, 0, 7, 1, 0, 0], [0, 0, 7, 1, 0, 1]])
    out_k = torch.full((1, 9, d), math.nan)
    out_v = out_k.clone()
    cos, sin = rope_tables(9, d, interleaved=False)
    reconstruct_layer(torch.zeros(1), segments, out_k, out_v, cos, sin)
    for out in (out_k, out_v):
        assert (out[0, 1:8] == 0).all() and out[0, 0].isnan().all() and out[0, 8].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_reference_rounds_the_fp32_result(dtype):
    kv_heads, d = 3, 64
    factors, segments, n_rows = random_layer(kv_heads, d, [13, 30], dtype, seed=5)
    cos, sin = rope_tables(n_rows, d, interleaved=True)
    full = [torch.full((kv_heads, n_rows, d), math.nan) for _ in range(2)]
    low = [torch.full((kv_heads, n_rows, d), math.nan, dtype=dtype) for _ in range(2)]
    reconstruct_layer(factors.float(), segments, *full, cos, sin, interleaved=True)
    reconstruct_layer(factors, segments, *low, cos, sin, interleaved=True)
    mask = target_mask(segments, kv_heads, n_rows, d)
    for kind in (0, 1):
        assert torch.equal(low[kind][mask[kind]], full[kind][mask[kind]].to(dtype))
        assert low[kind][~mask[kind]].isnan().all()


def valid_call(**override):
    """Arguments of a small valid call (one key segment of rank 2), with some replaced."""
    d, n_rows = 8, 10
    cos, sin = rope_tables(n_rows, d, interleaved=False)
    args = dict(factors=torch.zeros(2 * (4 + d + 1)), segments=torch.tensor([[0, 2, 4, 1, 0, 0]]),
                out_k=torch.zeros(2, n_rows, d), out_v=torch.zeros(2, n_rows, d), cos=cos, sin=sin)
    args.update(override)
    return args


@pytest.mark.parametrize("override, message", [
    (dict(factors=torch.zeros(26, dtype=torch.int32)), "factors must be"),
    (dict(factors=torch.zeros(2, 26)), "factors must be"),
    (dict(factors=torch.zeros(52)[::2]), "factors must be"),
    (dict(out_v=torch.zeros(3, 10, 8)), "out_k and out_v"),
    (dict(out_k=torch.zeros(2, 10, 8, dtype=torch.int32), out_v=torch.zeros(2, 10, 8, dtype=torch.int32)), "fp16"),
    (dict(out_k=torch.zeros(2, 10, 7), out_v=torch.zeros(2, 10, 7)), "even"),
    (dict(cos=torch.zeros(9, 8)), "cos must be"),
    (dict(sin=torch.zeros(10, 8, dtype=torch.float64)), "sin must be"),
    (dict(segments=torch.tensor([[0, 2, 4, 1, 0]])), "segments must be"),
    (dict(segments=torch.tensor([[0, 2, 4, 1, 0, 0]], dtype=torch.int32)), "segments must be"),
    (dict(segments=torch.tensor([[-1, 2, 4, 1, 0, 0]])), "src_offset is negative"),
    (dict(segments=torch.tensor([[0, 9, 1, 1, 0, 0]])), r"rank must be in \[0, d=8\]"),
    (dict(segments=torch.tensor([[0, 2, 0, 1, 0, 0]])), "tokens must be positive"),
    (dict(segments=torch.tensor([[1, 2, 4, 1, 0, 0]])), "reads past the end of factors"),
    (dict(segments=torch.tensor([[0, 2, 4, 7, 0, 0]])), "rows fall outside"),
    (dict(segments=torch.tensor([[0, 2, 4, -1, 0, 0]])), "dst_row is negative"),
    (dict(segments=torch.tensor([[0, 2, 4, 1, 2, 0]])), r"head must be in \[0, 2\)"),
    (dict(segments=torch.tensor([[0, 2, 4, 1, 0, 2]])), "kind must be 0"),
    (dict(segments=torch.tensor([[0, 2, 4, 1, 0, 0], [0, 1, 2, 4, 0, 0]])), "overlapping rows"),
])
def test_invalid_inputs_are_rejected_with_a_clear_message(override, message):
    with pytest.raises((ValueError, TypeError), match=message):
        reconstruct_layer(**valid_call(**override))


def test_same_rows_of_other_heads_and_kinds_do_not_overlap():
    """Segments at the same rows of another head or kind are accepted, and each is written where it says."""
    segments = torch.tensor([[0, 2, 4, 1, 0, 0], [0, 2, 4, 1, 1, 0], [0, 2, 4, 1, 0, 1], [0, 1, 2, 5, 0, 0]])
    factors = torch.randn(2 * (4 + 8 + 1), generator=torch.Generator().manual_seed(0))  # every segment reads from offset 0
    call = valid_call(segments=segments, factors=factors)
    got, want = nan_buffers(2, 10, 8, torch.float32), nan_buffers(2, 10, 8, torch.float32)
    reconstruct_layer(**dict(call, out_k=got[0], out_v=got[1]))
    reconstruct_layer_naive(**dict(call, out_k=want[0], out_v=want[1]))
    check_outputs(got, want, target_mask(segments, 2, 10, 8), atol=1e-5, rtol=1e-5)


def test_backend_choice(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        reconstruct_layer(**valid_call(), backend="fast")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        reconstruct_layer(**valid_call(), backend="triton")
    reconstruct_layer(**valid_call(), backend="reference")


@pytest.fixture
def unread_default(monkeypatch):
    """A process that has not read MILO_KERNEL yet; it reads it afresh after the test, once restored."""
    rk.default_backend.cache_clear()
    yield monkeypatch
    rk.default_backend.cache_clear()


def test_milo_kernel_sets_the_default_once(unread_default):
    unread_default.setenv("MILO_KERNEL", "fast")
    with pytest.raises(ValueError, match="MILO_KERNEL must be"):
        reconstruct_layer(**valid_call())
    unread_default.delenv("MILO_KERNEL")
    assert (kernel_backend("cpu"), kernel_backend("cuda")) == ("cpu", "triton")
    rk.default_backend.cache_clear()
    unread_default.setenv("MILO_KERNEL", "reference")
    assert (kernel_backend("cpu"), kernel_backend("cuda")) == ("reference", "reference")
    unread_default.setenv("MILO_KERNEL", "triton")
    assert kernel_backend("cpu") == "reference"  # read once: later changes to the environment switch nothing
    assert kernel_backend("cpu", "auto") == "cpu"  # an explicit backend still wins


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_import_and_reference_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, milo_kernels\n"
        "from milo_kernels import reconstruct_layer\n"
        "cos = sin = torch.ones(3, 4)\n"
        "k, v = torch.zeros(2, 1, 3, 4)\n"
        "reconstruct_layer(torch.ones(8), torch.tensor([[0, 1, 3, 0, 0, 1]]), k, v, cos, sin)\n"
        "assert (v == 1).all(), v\n"
        "try:\n"
        "    reconstruct_layer(torch.ones(8), torch.tensor([[0, 1, 3, 0, 0, 1]]), k, v, cos, sin, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'needs the triton package' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error without triton')\n"
    )
    result = run_python(code, MILO_KERNEL="")
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernel tests run in-process")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="already interpreting in-process")
def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(Path(__file__).with_name("test_reconstruct_triton.py"))
