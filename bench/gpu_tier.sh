#!/usr/bin/env bash
# The GPU tier as one prepared command for one lent GPU (H100/H200; <= 8 minutes). Output: OUT/
# (each stage's log, gpu_speed.json, the grid's results); the exit status is the first failing
# stage's (a test failed or a stage ran out of time), 0 when every stage passed. On a GPU node with
# trainkit installed:
#
#   bash bench/gpu_tier.sh OUT            # checks: tests, then nccl-timing and images (at most 7 min)
#   bash bench/gpu_tier.sh OUT tests      # the GPU tests one device can run (~4 min)
#   bash bench/gpu_tier.sh OUT speed      # bench/gpu_speed.py's speed and memory table (~5.5 min)
#   bash bench/gpu_tier.sh OUT grid       # the grid on one device (~3 min), recorded as `gpu-1`
#   bash bench/gpu_tier.sh OUT checkpoint # async_save's blocking time per save, pinned staging (~1.5 min)
#   bash bench/gpu_tier.sh OUT images     # JPEG decoding on the GPU against the loader's, images/s (~1 min)
#   bash bench/gpu_tier.sh OUT nccl-timing  # what NCCL's start events cost per collective (~20 s)
#   bash bench/gpu_tier.sh OUT install    # only the wheels below and the environment report
#
# Where the node lacks trainkit's dependencies and has no index, put their wheels in .whl/ (the
# device tool's machines: see docs/benchmarks.md, "GPU test tier"); they are installed into .gpu/site.
set -uo pipefail  # a stage's status is its command's, not tee's
OUT=${1:?usage: gpu_tier.sh OUT [checks|tests|speed|grid|checkpoint|images|nccl-timing|install]}
STAGE=${2:-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d .whl ] && [ ! -f .gpu/site/.installed ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu/site .whl/*.whl \
    && "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target .gpu/site . \
    && touch .gpu/site/.installed || { echo "install failed"; exit 1; }
fi
[ -d .gpu/site ] && export PYTHONPATH=$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
} 2>&1 | tee "$OUT/env.txt"

[ "$STAGE" = install ] && exit 0
STATUS=0
stage() {  # stage NAME TIMEOUT_S COMMAND...: its log in OUT/NAME.log, its status remembered
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "gpu_tier: stage $name exit $rc$([ "$rc" = 124 ] && echo ' (ran out of its time)')" | tee -a "$OUT/stages.txt"
  [ "$STATUS" = 0 ] && STATUS=$rc
  return 0
}
tests() {  # the GPU tests one device can run (the grid is its own stage)
  stage tests "${TESTS_TIMEOUT_S:-270}" "$PY" -m pytest -m gpu -q -rA -s -p no:randomly -p no:cacheprovider \
    --durations=0 tests/test_memory_oom_gpu.py tests/test_tensor_parallel_random.py tests/test_gpu.py \
    -k "not compatibility_grid"
}
nccl_timing() {  # TORCH_NCCL_ENABLE_TIMING=1 against 0, per collective
  stage nccl_timing 60 "$PY" bench/nccl_timing_overhead.py --pairs 9
}
images() {  # data.decode: device against the loader's decoding, per part
  stage image_decode 90 "$PY" bench/image_decode.py --device cuda --pairs 7 --images 256
}
case "$STAGE" in
  checks) tests; nccl_timing; images ;;
  tests) tests ;;
  nccl-timing) nccl_timing ;;
  images) images ;;
  speed)  # trainkit against a hand-written loop (bench/gpu_speed.py's table)
    stage gpu_speed "${SPEED_TIMEOUT_S:-330}" "$PY" bench/gpu_speed.py --out "$OUT" --steps 25 --warmup 10 --log-every 5 ;;
  checkpoint)  # async_save's blocking time with pinned, reused staging
    stage checkpoint 240 "$PY" bench/checkpoint_blocking.py --device cuda --nproc 1 --pairs 5 ;;
  grid)
    stage grid 300 env TRAINKIT_GRID_RECORD=1 TRAINKIT_GRID_TIMEOUT_S="${GRID_TIMEOUT_S:-240}" "$PY" -m pytest -m gpu \
      -q -rA -p no:randomly -p no:cacheprovider tests/test_gpu.py -k one_cuda_device
    cp docs/compatibility-results.json "$OUT/" ;;
  *) echo "gpu_tier: no stage $STAGE" >&2; exit 2 ;;
esac
exit "$STATUS"
