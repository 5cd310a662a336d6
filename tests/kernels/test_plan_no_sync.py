"""`reconstruct_layer` / `plan_layer` on device tensors with a CPU segment table never read the device.

Tensors on the 'meta' device have no data: any read-back (.cpu(), .item(), bool(), int()) raises. So a
full pass of validation, planning and launch over meta factors and buffers, with the kernel replaced by a
recorder, proves the host path reads nothing from the device (on CUDA each read would be a sync)."""
import pytest
import torch

pytest.importorskip("triton")
from milo_kernels import plan as planning, reconstruct as rk, triton_kernel  # noqa: E402
from milo_store.codecs.quant import pack_segment  # noqa: E402


class Recorder:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def meta_triton(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(triton_kernel, "require_triton", lambda factors: None)
    monkeypatch.setattr(triton_kernel, "kernel", lambda: recorder)
    return recorder


def int4_layer(d=64, tokens=(40, 70)):
    parts, segments, at, row = [], [], 0, 0
    for t in tokens:
        for kind in (0, 1):
            raw = pack_segment(torch.randn(t, 5), torch.ones(5), torch.randn(d, 5), "int4", kind)
            parts.append(raw)
            segments.append([at, 5, t, row, 0, kind])
            at += raw.numel()
        row += t
    return torch.cat(parts), torch.tensor(segments), row


@pytest.mark.parametrize("quant", [None, "int4"])
def test_reconstruct_layer_reads_nothing_back_from_the_device(meta_triton, quant):
    d = 64
    raw, segments, n = int4_layer(d)
    if quant is None:  # a floating layer with the same table shape
        segments[:, 0] = torch.arange(len(segments)) * 5 * (70 + d + 1)
        factors = torch.empty(len(segments) * 5 * (70 + d + 1), dtype=torch.float16, device="meta")
    else:
        factors = torch.empty(raw.numel(), dtype=torch.uint8, device="meta")
    out_k, out_v = torch.empty(2, 1, n, d, dtype=torch.float16, device="meta")
    cos = sin = torch.empty(n, d, device="meta")
    rk.reconstruct_layer(factors, segments, out_k, out_v, cos, sin, quant=quant, backend="triton")
    (grid, args, kwargs), = meta_triton.calls
    tiles = args[2]
    assert tiles.device.type == "meta" and grid == (tiles.shape[0], d // 2 // kwargs["BLOCK_H"])
    assert grid[0] == sum(-(-t // kwargs["BLOCK_T"]) for t in segments[:, 2].tolist())
    assert kwargs["BITS"] == (4 if quant else 0)


def test_planning_every_layer_at_once_reads_nothing_back(meta_triton):
    """The query path's form: plan_layers on the host for all layers, then per-layer launches."""
    d = 64
    raw, segments, n = int4_layer(d)
    plans = planning.plan_layers(torch.stack([segments, segments]), d, factor_dtype=torch.uint8, device="meta", quant="int4")
    factors = torch.empty(raw.numel(), dtype=torch.uint8, device="meta")
    out_k, out_v = torch.empty(2, 1, n, d, dtype=torch.float16, device="meta")
    cos = sin = torch.empty(n, d, device="meta")
    for plan in plans:
        rk.reconstruct_layer(factors, segments, out_k, out_v, cos, sin, quant="int4", plan=plan, backend="triton")
    assert len(meta_triton.calls) == 2 and all(call[1][2].device.type == "meta" for call in meta_triton.calls)
    assert plans[0].need_rows == n and plans[0].need_numel == raw.numel() and plans[0].bits == 4


def test_plan_layers_checks_each_layer():
    """Overlapping rows are refused within a layer, allowed across layers; structure is checked too."""
    one = torch.tensor([[0, 2, 4, 0, 0, 0], [40, 2, 4, 4, 0, 0]])
    planning.plan_layers(torch.stack([one, one]), 16, factor_dtype=torch.float16, device="cpu")
    overlapping = one.clone()
    overlapping[1, 3] = 2
    with pytest.raises(ValueError, match="overlapping rows"):
        planning.plan_layers(torch.stack([one, overlapping]), 16, factor_dtype=torch.float16, device="cpu")
    bad = one.clone()
    bad[0, 1] = 17
    with pytest.raises(ValueError, match=r"rank must be in \[0, d=16\]"):
        planning.plan_layers(torch.stack([one, bad]), 16, factor_dtype=torch.float16, device="cpu")


def test_a_device_segment_table_is_read_back(meta_triton):
    """The control: the same call with the table on the device does read it (here: raises)."""
    raw, segments, n = int4_layer()
    factors = torch.empty(raw.numel(), dtype=torch.uint8, device="meta")
    out_k, out_v = torch.empty(2, 1, n, 64, dtype=torch.float16, device="meta")
    cos = sin = torch.empty(n, 64, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        rk.reconstruct_layer(factors, segments.to("meta"), out_k, out_v, cos, sin, quant="int4", backend="triton")


def test_tile_table_goes_to_cuda_pinned_and_non_blocking(monkeypatch):
    """Checked without a GPU by recording the calls: pinned host memory, then one non-blocking copy."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, **kw: calls.append((str(device), kw)) or self)
    table = torch.zeros(3, 7, dtype=torch.int64)
    planning._upload(table, torch.device("cuda", 0))
    assert calls == ["pin", ("cuda:0", {"non_blocking": True})]
    calls.clear()
    planning._upload(table, torch.device("cpu"))  # CPU-only runs never pin (pinning needs CUDA)
    assert calls == [("cpu", {})]
