#!/usr/bin/env bash
# The GPU sweep (issue 40), one command on a CUDA machine without internet: a Qwen2.5-7B-shaped model with random
# bf16 weights, a synthetic store of 512 demonstrations (16 blocks of 640 tokens), k = 8, full-KV offload (the
# identity store copied, "full", and rebuilt as X·I, "full-gemm", through the same engine) against MILO at
# rho 0.5 and 0.25 (milo build's defaults: INT8 and INT4 factors), at batches of 1, 8, 32 and the largest the KV
# budget seats, 16 queries each, one round: queries/s, transfer / rebuild / model ms per query and per forward,
# the K/V bytes the pools allocated beside what the rows needed, device memory at most, pinned H2D bandwidth.
# Then `milo serve` over the rho 0.5 and the full store at 1, 16 and 64 streaming clients (tools/bench_serve.py,
# the same random model).
# Stage times are CUDA events on the stream that ran each stage. Reports land in $OUT/gpu_bench (or
# /tmp/gpu_bench), stores in a temp dir; extra arguments go to the throughput run.
#
#   --device cpu   the same pipeline at tiny shapes on the CPU, in about a minute (tests/infer/bench runs it)
#   ATTENTION=rows  the per-row SDPA loop instead of FlexAttention (the GPU's default) in both runs
#
# Packages the device image lacks travel as wheels in .whl (tools/gpu_wheels.py fetches them where pip
# works); where the python cannot import them and .whl is there, they are installed into /tmp/site first. Without CUDA (and without --device cpu)
# it exits 0 with one line. Stays under 4.5 minutes (150 s for the sweep, 100 s for serve, each its own timeout,
# as a device lease of ~5 minutes allows); a run its timeout stops leaves what it measured: the sweep writes its
# report after each batch and prints each method's seconds and the graphs torch.compile made (FlexAttention's), the
# serve run its JSON after each level. Exit status: nonzero if any run failed (124: a timeout).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then
  DEVICE=$2
  shift 2
fi
if ! "$PY" -c 'import zarr, fastapi, uvicorn, openai' >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_bench: the carried wheels did not install"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  echo "gpu_bench: skipped, no CUDA device visible to $PY"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET MILO_KERNEL
REPORTS=${OUT:-/tmp}/gpu_bench
STORES=$(mktemp -d "${TMPDIR:-/tmp}/milo-gpu-bench.XXXXXX")
trap 'rm -rf "$STORES"' EXIT
mkdir -p "$REPORTS"
if [ "$DEVICE" = cpu ]; then  # tiny shapes: the pipeline, not the numbers
  SHAPE=tiny; SHOTS=64; BLOCK=8; TOKENS=12; BATCHES=1,2,max; QUERIES=2; ROUNDS=1; CLIENTS=1,2; REQUESTS=4
  EXTRA=(--kv-cache-memory 4M --threads 1); SERVE_EXTRA=(--kv-cache-memory 4M --threads 1); BENCH_S=240; SERVE_S=240
else
  SHAPE=qwen2.5-7b; SHOTS=512; BLOCK=32; TOKENS=20; BATCHES=1,8,32,max; QUERIES=16; ROUNDS=1; CLIENTS=1,16,64
  REQUESTS=32; EXTRA=(); SERVE_EXTRA=(); BENCH_S=${BENCH_S:-150}; SERVE_S=${SERVE_S:-100}
fi
status=0
echo "== throughput on $("$PY" -c "import torch; print(torch.cuda.get_device_name() if '$DEVICE' == 'cuda' else 'cpu')")"
timeout -k 10 "$BENCH_S" "$PY" -m milo_infer.cli.bench --synthetic "$SHAPE" --device "$DEVICE" --shots "$SHOTS" \
  --block-size "$BLOCK" --demo-tokens "$TOKENS" --stores "$STORES" --k 8 --batch "$BATCHES" --n-queries "$QUERIES" \
  --rounds "$ROUNDS" --attention "${ATTENTION:-auto}" --out "$REPORTS/throughput" "${EXTRA[@]}" "$@" || status=$?
said() { [ "$1" = 124 ] && echo "gpu_bench: $2 hit its $3 s timeout; what it measured is in $4" || true; }
said "$status" "the throughput run" "$BENCH_S" "$REPORTS/throughput/bench.md"
echo "== serve: milo serve over the rho 0.5 and the full store, $CLIENTS streaming clients (tools/bench_serve.py)"
timeout -k 10 "$SERVE_S" "$PY" tools/bench_serve.py "$STORES/milo-r0.5" "$STORES/full" --synthetic "$SHAPE" \
  --device "$DEVICE" --k 8 --max-batch 64 --concurrency "$CLIENTS" --requests "$REQUESTS" --memory-requests 0 \
  --attention "${ATTENTION:-auto}" --start-timeout 90 --out "$REPORTS/serve.json" "${SERVE_EXTRA[@]}" \
  || { code=$?; said "$code" "the serve run" "$SERVE_S" "$REPORTS/serve.json"; status=$code; }
exit "$status"
