#!/usr/bin/env bash
# The GPU tier as one prepared command for one lent GPU (H100/H200; <= 8 minutes): the speed and
# memory figures of bench/gpu_speed.py, then the GPU tests that need no second GPU, then (stage
# "grid") the compatibility grid on one CUDA device. Output: OUT/ (logs, gpu_speed.json, the grid's
# results). On a GPU node with trainkit installed:
#
#   bash bench/gpu_tier.sh OUT            # speed + tests  (~7 min on one H200)
#   bash bench/gpu_tier.sh OUT grid       # the grid on one device (~3 min), recorded as `gpu-1`
#   bash bench/gpu_tier.sh OUT checkpoint # async_save's blocking time per save, pinned staging (~1.5 min)
#   bash bench/gpu_tier.sh OUT images     # JPEG decoding on the GPU against the loader's, images/s (~1 min)
#   bash bench/gpu_tier.sh OUT nccl-timing  # what NCCL's start events cost per collective (~20 s)
#   bash bench/gpu_tier.sh OUT install    # only the wheels below and the environment report
#
# Where the node lacks trainkit's dependencies and has no index, put their wheels in .whl/ (the
# device tool's machines: see docs/benchmarks.md, "GPU test tier"); they are installed into .gpu/site.
set -u
OUT=${1:?usage: gpu_tier.sh OUT [grid]}
STAGE=${2:-speed}
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
if [ "$STAGE" = checkpoint ]; then  # async_save's blocking time with pinned, reused staging (~1.5 min)
  timeout 240 "$PY" bench/checkpoint_blocking.py --device cuda --nproc 1 --pairs 5 2>&1 | tee "$OUT/checkpoint.log"
  exit 0
fi
if [ "$STAGE" = images ]; then  # data.decode: device against the loader's decoding, per part (~1 min)
  timeout 120 "$PY" bench/image_decode.py --device cuda --pairs 7 --images 256 2>&1 | tee "$OUT/image_decode.log"
  exit 0
fi
if [ "$STAGE" = nccl-timing ]; then  # TORCH_NCCL_ENABLE_TIMING=1 against 0, per collective (~20 s)
  timeout 120 "$PY" bench/nccl_timing_overhead.py --pairs 9 2>&1 | tee "$OUT/nccl_timing.log"
  exit 0
fi
if [ "$STAGE" = grid ]; then
  TRAINKIT_GRID_RECORD=1 TRAINKIT_GRID_TIMEOUT_S=${GRID_TIMEOUT_S:-240} timeout 300 "$PY" -m pytest -m gpu -q -rA \
    -p no:randomly -p no:cacheprovider tests/test_gpu.py -k one_cuda_device 2>&1 | tee "$OUT/grid.log"
  cp docs/compatibility-results.json "$OUT/"
  exit 0
fi

# 1. speed and memory, trainkit against a hand-written loop (bench/gpu_speed.py's table)
timeout ${SPEED_TIMEOUT_S:-330} "$PY" bench/gpu_speed.py --out "$OUT" --steps 25 --warmup 10 --log-every 5 \
  2>&1 | tee "$OUT/gpu_speed.log"
# 2. the GPU tests one device can run (the grid is its own stage)
timeout ${TESTS_TIMEOUT_S:-170} "$PY" -m pytest -m gpu -q -rA -s -p no:randomly -p no:cacheprovider --durations=0 \
  tests/test_memory_oom_gpu.py tests/test_tensor_parallel_random.py tests/test_gpu.py -k "not compatibility_grid" 2>&1 | tee "$OUT/tests.log"
