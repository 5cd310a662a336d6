#!/usr/bin/env bash
# The GPU bench (issues 40 and 55), one command on a CUDA machine without internet, inside one 10-minute device run:
# a Qwen2.5-7B-shaped model with random bf16 weights over synthetic stores (demonstrations of 20 tokens, blocks of
# 32: 640 tokens), k = 8, in four parts, each with its own timeout and writing its report as it goes:
#
#   1. profile  (PROFILE_S, 75 s): one decode step op by op (tools/profile_step.py: ops by time, launches, kernels,
#      device idle, host gaps, H2D/D2H copies, syncs and where they come from) at 8 and 32 rows -> profile.txt/json;
#   2. sweep    (SWEEP_S, 200 s): the shared-block regime, 512 demonstrations in 16 blocks: full-KV offload (the
#      identity store copied, "full", and rebuilt as X·I, "full-gemm"), "prefill" (the model prefills each row's
#      retrieved demonstrations: what a user does without milo, with its time to first token) and MILO at rho 0.5,
#      at batches 8, 32, 256 and the largest the KV budget seats -> throughput-MODE/bench.md (SHARED, below);
#   3. distinct (DISTINCT_S, 130 s): the distinct-block regime, 2,048 demonstrations in 64 blocks (built on the
#      device, issue 55: 200 s before), batches of 4 and 8 whose rows' blocks are all distinct, the same methods
#      -> distinct/bench.md;
#   4. serve    (SERVE_S, 170 s): `milo serve` over the rho 0.5 store, warmed up before /health answers 200, at 1,
#      16 and 64 streaming clients, each level run twice in a row (first vs repeated q/s: what the first traffic
#      paid for compiling), then with sampled requests asking for top-5 log probabilities beside the greedy ones
#      (issue 63), no client warm-up (tools/bench_serve.py) -> serve.json.
#
# 575 s of parts in all, each cut at its timeout keeping what it measured; the device's start and the model loads
# are outside. Two more parts, not in the default PARTS (they fit one device run of their own, PARTS="hybrid
# conformance", 420 s):
#
#   5. hybrid      (LINEAR_S + HYBRID_S, 60 + 180 s): a Qwen3.5-0.8B-shaped hybrid (18 Gated DeltaNet layers beside 6
#      attention layers): a decode step's linear layers at 1, 16 and 64 rows (tools/bench_linear_rows.py) ->
#      linear_rows.txt/json, then milo bench over 512 demonstrations in 16 blocks, k = 6, batches 1, 16 and the
#      largest the KV budget seats, full, prefill and MILO at rho 0.5 -> hybrid/bench.md (issue 72);
#   6. conformance (CONFORMANCE_S, 180 s): tests/infer/test_conformance.py with every family's tiny model on the
#      device (MILO_TEST_DEVICE, tests/infer/families.py) -> conformance.txt; needs pytest and hypothesis there.
#
# Stage times are CUDA events on the stream that ran each stage. Reports land in $OUT/gpu_bench (or
# /tmp/gpu_bench), stores in a temp dir; extra arguments go to the throughput runs.
#
#   --device cpu   the same parts at tiny shapes on the CPU, the four in about two minutes (tests/infer/bench runs
#                  them, and the two more), the conformance part over LFM2's tiny model alone
#   ATTENTION=rows  the per-row SDPA loop instead of FlexAttention (the GPU's default) in every part
#   SHARED=on,off   blocks held once for every row (on), each row's own copy (off), or both (issue 54): the sweep
#                   runs once per mode (reports in throughput-MODE), serve serves each mode in turn, the profile and
#                   the distinct-block run take the first (default on; on,off fits one device run with PARTS=sweep)
#   PARTS="profile sweep distinct serve"   the parts to run (default these four; hybrid and conformance on asking)
#
# Packages the device image lacks travel as wheels in .whl (tools/gpu_wheels.py fetches them where pip
# works); where the python cannot import them and .whl is there, they are installed into /tmp/site first. Without
# CUDA (and without --device cpu) it exits 0 with one line. Exit status: nonzero if any part failed (124: a timeout).
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
PARTS=${PARTS:-profile sweep distinct serve}
ATTENTION=${ATTENTION:-auto}
SHARED=${SHARED:-on}
FIRST_SHARED=${SHARED%%,*}
if [ "$DEVICE" = cpu ]; then  # tiny shapes: the pipeline, not the numbers
  SHAPE=tiny; SHOTS=64; BLOCK=8; TOKENS=12; BATCHES=1,2,max; QUERIES=2; CLIENTS=1,2; REQUESTS=4; PROFILE_ROWS=1,2
  DISTINCT_SHOTS=256; DISTINCT_BLOCK=4; MAX_BATCH=8; WARMUP=all  # the warm-up's path, though rows compile nothing
  EXTRA=(--kv-cache-memory 4M --threads 1); SERVE_EXTRA=(--kv-cache-memory 4M --threads 1)
  PROFILE_S=120; SWEEP_S=240; DISTINCT_S=240; SERVE_S=240
  HYBRID=qwen3.5-tiny; HYBRID_SHOTS=32; HYBRID_BLOCK=8; HYBRID_BATCHES=1,2; HYBRID_QUERIES=2; LINEAR_ROWS=1,2
  CONFORMANCE_K=(-k lfm2); LINEAR_S=120; HYBRID_S=240; CONFORMANCE_S=240
else
  SHAPE=qwen2.5-7b; SHOTS=512; BLOCK=32; TOKENS=20; BATCHES=8,32,256,max; QUERIES=16; CLIENTS=1,16,64; REQUESTS=32
  PROFILE_ROWS=8,32; DISTINCT_SHOTS=2048; DISTINCT_BLOCK=32; MAX_BATCH=64; WARMUP=auto; EXTRA=(); SERVE_EXTRA=()
  PROFILE_S=${PROFILE_S:-75}; SWEEP_S=${SWEEP_S:-200}; DISTINCT_S=${DISTINCT_S:-130}; SERVE_S=${SERVE_S:-170}
  HYBRID=qwen3.5-0.8b; HYBRID_SHOTS=512; HYBRID_BLOCK=32; HYBRID_BATCHES=1,16,max; HYBRID_QUERIES=16
  LINEAR_ROWS=1,16,64; CONFORMANCE_K=(); LINEAR_S=${LINEAR_S:-60}; HYBRID_S=${HYBRID_S:-180}
  CONFORMANCE_S=${CONFORMANCE_S:-180}
fi
status=0
said() { [ "$1" = 124 ] && echo "gpu_bench: $2 hit its $3 s timeout; what it measured is in $4" || true; }
wants() { [[ " $PARTS " == *" $1 "* ]]; }
echo "== on $("$PY" -c "import torch; print(torch.cuda.get_device_name() if '$DEVICE' == 'cuda' else 'cpu')"), parts: $PARTS"
if wants profile; then
  echo "== profile: a decode step op by op at $PROFILE_ROWS rows (tools/profile_step.py)"
  timeout -k 10 "$PROFILE_S" "$PY" tools/profile_step.py --synthetic "$SHAPE" --device "$DEVICE" --rows "$PROFILE_ROWS" \
    --steps 3 --shots "$SHOTS" --block-size "$BLOCK" --demo-tokens "$TOKENS" --k 8 --attention "$ATTENTION" \
    --stores "$STORES/profile" --out "$REPORTS/profile.json" ${EXTRA[@]+"${EXTRA[@]}"} \
    --shared-blocks "$FIRST_SHARED" | tee "$REPORTS/profile.txt"
  code=${PIPESTATUS[0]}; said "$code" "the profile" "$PROFILE_S" "$REPORTS/profile.txt"; [ "$code" = 0 ] || status=$code
fi
if wants sweep; then
  for mode in ${SHARED//,/ }; do
    echo "== sweep (rows sharing blocks; held once: $mode): $SHOTS demonstrations in blocks of $BLOCK, batches $BATCHES, with prefill"
    timeout -k 10 "$SWEEP_S" "$PY" -m milo_infer.cli.bench --synthetic "$SHAPE" --device "$DEVICE" --shots "$SHOTS" \
      --block-size "$BLOCK" --demo-tokens "$TOKENS" --stores "$STORES/sweep" --k 8 --batch "$BATCHES" \
      --n-queries "$QUERIES" --rounds 1 --ratios 0.5 --prefill --attention "$ATTENTION" \
      --out "$REPORTS/throughput-$mode" --shared-blocks "$mode" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
    code=$?; said "$code" "the sweep" "$SWEEP_S" "$REPORTS/throughput-$mode/bench.md"; [ "$code" = 0 ] || status=$code
  done
fi
if wants distinct; then
  echo "== distinct blocks: $DISTINCT_SHOTS demonstrations in blocks of $DISTINCT_BLOCK, batches 4 and 8"
  timeout -k 10 "$DISTINCT_S" "$PY" -m milo_infer.cli.bench --synthetic "$SHAPE" --device "$DEVICE" \
    --shots "$DISTINCT_SHOTS" --block-size "$DISTINCT_BLOCK" --demo-tokens "$TOKENS" --stores "$STORES/distinct" --k 8 \
    --batch 4,8 --n-queries 8 --rounds 1 --ratios 0.5 --prefill --attention "$ATTENTION" --out "$REPORTS/distinct" \
    --shared-blocks "$FIRST_SHARED" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
  code=$?; said "$code" "the distinct-block run" "$DISTINCT_S" "$REPORTS/distinct/bench.md"; [ "$code" = 0 ] || status=$code
fi
if wants serve; then
  SERVED="$STORES/sweep/milo-r0.5"
  if [ ! -d "$SERVED" ]; then  # the sweep did not run (PARTS): the store alone, MILO's only
    "$PY" -c "import sys; from milo_infer.bench import synthetic_model as s; l = s.device_model('$SHAPE', '$DEVICE'); \
s.synthetic_stores('$STORES/sweep', l, demos=$SHOTS, block_size=$BLOCK, demo_tokens=$TOKENS, ratios=(0.5,), methods='milo')"
  fi
  echo "== serve: milo serve over the rho 0.5 store, warmed up, $CLIENTS streaming clients, each level twice"
  timeout -k 10 "$SERVE_S" "$PY" tools/bench_serve.py "$SERVED" --synthetic "$SHAPE" --device "$DEVICE" --k 8 \
    --max-batch "$MAX_BATCH" --concurrency "$CLIENTS" --requests "$REQUESTS" --memory-requests 0 --client-warmup 0 \
    --repeat --sampled --warmup "$WARMUP" --attention "$ATTENTION" --start-timeout "$((SERVE_S - 20))" --out "$REPORTS/serve.json" \
    --shared-blocks "$SHARED" ${SERVE_EXTRA[@]+"${SERVE_EXTRA[@]}"}
  code=$?; said "$code" "the serve run" "$SERVE_S" "$REPORTS/serve.json"; [ "$code" = 0 ] || status=$code
fi
if wants hybrid; then
  echo "== hybrid: $HYBRID, a decode step's linear layers at $LINEAR_ROWS rows (tools/bench_linear_rows.py)"
  THREADS=(); [ "$DEVICE" = cpu ] && THREADS=(--threads 1)
  timeout -k 10 "$LINEAR_S" "$PY" tools/bench_linear_rows.py --shape "$HYBRID" --rows "$LINEAR_ROWS" \
    --device "$DEVICE" --json "$REPORTS/linear_rows.json" ${THREADS[@]+"${THREADS[@]}"} | tee "$REPORTS/linear_rows.txt"
  code=${PIPESTATUS[0]}; said "$code" "the linear layers' run" "$LINEAR_S" "$REPORTS/linear_rows.txt"
  [ "$code" = 0 ] || status=$code
  echo "== hybrid: $HYBRID_SHOTS demonstrations in blocks of $HYBRID_BLOCK, k 6, batches $HYBRID_BATCHES, with prefill"
  timeout -k 10 "$HYBRID_S" "$PY" -m milo_infer.cli.bench --synthetic "$HYBRID" --device "$DEVICE" \
    --shots "$HYBRID_SHOTS" --block-size "$HYBRID_BLOCK" --demo-tokens "$TOKENS" --stores "$STORES/hybrid" --k 6 \
    --batch "$HYBRID_BATCHES" --n-queries "$HYBRID_QUERIES" --rounds 1 --ratios 0.5 --prefill --attention "$ATTENTION" \
    --out "$REPORTS/hybrid" --shared-blocks "$FIRST_SHARED" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
  code=$?; said "$code" "the hybrid run" "$HYBRID_S" "$REPORTS/hybrid/bench.md"; [ "$code" = 0 ] || status=$code
fi
if wants conformance; then
  echo "== conformance: tests/infer/test_conformance.py, every family's tiny model on $DEVICE"
  MILO_TEST_DEVICE="$DEVICE" timeout -k 10 "$CONFORMANCE_S" "$PY" -m pytest -q -p no:cacheprovider \
    tests/infer/test_conformance.py ${CONFORMANCE_K[@]+"${CONFORMANCE_K[@]}"} 2>&1 | tee "$REPORTS/conformance.txt"
  code=${PIPESTATUS[0]}; said "$code" "the conformance run" "$CONFORMANCE_S" "$REPORTS/conformance.txt"
  [ "$code" = 0 ] || status=$code
fi
exit "$status"
