#!/usr/bin/env bash
# The one GPU check for milo_kernels, for a CUDA machine without internet (torch + triton + pytest installed):
# the kernel tests on the GPU, the fused INT4/INT2 tests timed on their own, then tools/bench_kernels.py
# (timings incl. INT8/INT4/INT2 rows, GB/s vs a device copy, H2D copies; every checked launch writes into
# NaN-poisoned outputs), and once more with half the segments raw (--raw-share 0.5, no tile sweep). Exits 0
# with one line when the python has no CUDA. Extra arguments go to the first bench_kernels.py. Stays within
# ~6 minutes: each step has its own timeout. Exit status: nonzero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  echo "gpu_check: skipped, no CUDA device visible to $PY"
  exit 0
fi
if ! "$PY" -c 'import zarr' >/dev/null 2>&1; then  # the INT8/INT4/INT2 tests and rows pack segments with milo_store
  echo "gpu_check: $PY has no zarr (milo_store imports it): install zarr, numcodecs, donfig, google-crc32c first"
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET MILO_KERNEL
status=0
echo "== pytest tests/kernels on $("$PY" -c 'import torch, triton; print(torch.cuda.get_device_name(), "triton", triton.__version__)')"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels --ignore=tests/kernels/test_reconstruct_lowbit.py || status=$?
echo "== the fused INT4/INT2 kernel tests, timed"
SECONDS=0
timeout 60 "$PY" -m pytest -q -p no:cacheprovider --durations=5 tests/kernels/test_reconstruct_lowbit.py || status=$?
echo "INT4/INT2 kernel tests: ${SECONDS} s"
echo "== tools/bench_kernels.py"
timeout 180 "$PY" tools/bench_kernels.py "$@" || status=$?
echo "== tools/bench_kernels.py --raw-share 0.5 (raw segments among factored ones)"
timeout 90 "$PY" tools/bench_kernels.py --no-sweep --raw-share 0.5 --out "${OUT:-.}/gpu_check_raw.json" || status=$?
exit "$status"
