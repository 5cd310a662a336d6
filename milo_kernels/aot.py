"""Compile the reconstruction kernel ahead of time for a GPU target, without a GPU, and read its resources.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` runs the whole pipeline down to a
cubin; `ptxas -v` (shipped in the triton wheel) on the PTX reports registers, spills and static shared
memory, and the compiled metadata the dynamic shared memory. `variants` lists every kernel the query
path can launch (what `plan.tile_config` picks for each factor dtype, RoPE layout and head dim; dtype
`bits` is the bit-code kernel of `milo_kernels.bits` with `bits.bits_tile_config`'s tiles); tools/compile_kernels.py prints the table, tests/kernels/test_compile.py checks a subset.
"""
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from milo_format import SCALE_SPAN, QUANT_BITS

FACTORS = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32", "int8": "*u8", "int4": "*u8", "int2": "*u8",
           "bits": "*u8"}  # bits: the per-component bit-code kernel (milo_kernels.bits), writing fp16
OUTPUT = {"bf16": "*bf16", "fp32": "*fp32"}  # outputs follow the factors' dtype; quantized ones write fp16
HEAD_DIMS = (64, 128, 256)
# per compute capability: registers and shared memory per SM, the most a block may take, warps per SM
SM = {80: dict(regs=65536, smem=167936, smem_block=166912, warps=64),
      90: dict(regs=65536, smem=233472, smem_block=232448, warps=64)}


@dataclass(frozen=True)
class Variant:
    dtype: str
    interleaved: bool
    d: int
    partial: bool = False  # rotate-half over the first rotary_dim channels only (the kernels' PARTIAL)

    @property
    def name(self) -> str:
        layout = "inter" if self.interleaved else "partial" if self.partial else "half"
        return f"{self.dtype}-{layout}-d{self.d}"


LAYOUTS = {"half": (False, False), "inter": (True, False), "partial": (False, True)}  # (interleaved, partial)


def variants(dtypes=tuple(FACTORS), head_dims=HEAD_DIMS, layouts=tuple(LAYOUTS)) -> list[Variant]:
    return [Variant(t, LAYOUTS[layout][0], d, LAYOUTS[layout][1]) for t in dtypes for d in head_dims
            for layout in layouts]


def launch_config(v: Variant) -> dict:
    from .bits import bits_tile_config
    from .plan import tile_config
    return bits_tile_config(v.d) if v.dtype == "bits" else tile_config(v.d)


def kernel_and_arguments(v: Variant, config: dict):
    """(the JIT kernel, its pointer and scalar argument types, its constants) for one variant."""
    from .triton_kernel import bits_kernel_for, kernel_for

    tiles = dict(BLOCK_T=config["block_t"], BLOCK_R=config["block_r"], BLOCK_H=config["block_h"])
    out = OUTPUT.get(v.dtype, "*fp16")
    if v.dtype == "bits":
        args = dict(DATA="*u8", COMPONENTS="*i64", TILES="*i64", SCALE="*fp32", K=out, V=out, COS="*fp32",
                    SIN="*fp32", D="i32", ROT_HALF="i32")
        return bits_kernel_for(False), args, dict(INTERLEAVED=v.interleaved, PARTIAL=v.partial, **tiles)
    factor = FACTORS[v.dtype]
    args = dict(F=factor, F16="*fp16" if v.dtype in QUANT_BITS else factor, TILES="*i64", K=out, V=out,
                COS="*fp32", SIN="*fp32", D="i32", ROT_HALF="i32")
    return kernel_for(False), args, dict(BITS=QUANT_BITS.get(v.dtype, 0), SPAN=SCALE_SPAN, INTERLEAVED=v.interleaved,
                                         PARTIAL=v.partial,
                                         IEEE_DOT=v.dtype == "fp32", **tiles)


def compile_variant(v: Variant, cc: int) -> dict:
    """Compile one variant for sm_<cc>; returns its launch config, compile seconds and resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated (silences its warning)
    config = launch_config(v)
    kernel, args, constants = kernel_and_arguments(v, config)
    args |= {name: "i32" for name in kernel.arg_names if name.startswith("s")}
    declared = {p.name for p in kernel.params if p.is_constexpr}
    if declared != set(constants):  # ASTSource takes our word for it; a launch takes the kernel's
        raise RuntimeError(f"the kernel declares constexprs {sorted(declared)}, a launch passes {sorted(constants)}")
    signature = {name: args.get(name, "constexpr") for name in kernel.arg_names}
    # the JIT marks 16-byte aligned pointers (torch allocations are) and d (a multiple of 16) divisible by 16
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if args.get(name, "").startswith("*") or name == "D"}
    target = GPUTarget("cuda", cc, 32)
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature, constants, aligned), target=target, options=options)
    seconds = time.perf_counter() - start
    usage = ptxas_usage(compiled.asm["ptx"], cc)
    shared = compiled.metadata.shared + usage["static_smem"]
    return dict(variant=v.name, **asdict(v), cc=cc, triton=triton.__version__, **config,
                compile_s=round(seconds, 2), registers=usage["registers"], spill_bytes=usage["spill_bytes"],
                shared_bytes=shared, **occupancy(usage["registers"], shared, config["num_warps"], cc))


def ptxas_usage(ptx: str, cc: int) -> dict:
    """Registers, spill bytes (stores + loads) and static shared memory that `ptxas -v` reports for the PTX."""
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        report = subprocess.run([ptxas_path(cc), "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    number = lambda pattern: sum(int(m) for m in re.findall(pattern, report))  # noqa: E731
    return dict(registers=number(r"Used (\d+) registers"),
                spill_bytes=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
                static_smem=number(r"(\d+) bytes smem"))


def ptxas_path(cc: int) -> str:
    """The ptxas triton itself uses for this target (the wheel ships one per PTX generation)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(cc).path


def occupancy(registers: int, shared: int, num_warps: int, cc: int) -> dict:
    """Blocks per SM and the fraction of its warp slots they fill, limited by registers, shared memory
    and warp slots (registers are allocated per warp in units of 256; 1 KiB of shared memory per block is
    reserved by the driver)."""
    sm = SM[cc]
    warp_regs = -(-max(registers, 1) * 32 // 256) * 256
    limits = {"regs": sm["regs"] // warp_regs // num_warps, "warps": sm["warps"] // num_warps, "blocks": 32}
    if shared:
        limits["smem"] = sm["smem"] // (shared + 1024) if shared <= sm["smem_block"] else 0
    limiter = min(limits, key=limits.get)
    blocks = limits[limiter]
    return dict(blocks_per_sm=blocks, occupancy=round(blocks * num_warps / sm["warps"], 3), limited_by=limiter)
