#!/usr/bin/env bash
# The one GPU check for milo_kernels, for a CUDA machine without internet (torch + triton + pytest installed):
# the kernel tests on the GPU, then tools/bench_kernels.py (timings, GB/s vs a device copy, H2D copies).
# Exits 0 with one line when the python has no CUDA. Extra arguments go to bench_kernels.py.
# Stays under 8 minutes: each step has its own timeout. Exit status: nonzero if either step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  echo "gpu_check: skipped, no CUDA device visible to $PY"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET MILO_KERNEL
status=0
echo "== pytest tests/kernels on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
timeout 210 "$PY" -m pytest -q -p no:cacheprovider tests/kernels || status=$?
echo "== tools/bench_kernels.py"
timeout 240 "$PY" tools/bench_kernels.py "$@" || status=$?
exit "$status"
