#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks; a short table is printed last.
# Usage on the GPU machine, from the repo root: bash scripts/gpu_check.sh [quick|profile]
# (no argument: tests + benchmarks; quick: tests; profile: tests + step profile; all)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
REPO=$(pwd)
PY=${PY:-python3}
$PY -m pip install -q -e . --no-deps --no-build-isolation >"$OUT/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader

# Tests run from outside the repo so `kernels` can never resolve to its folder.
(cd /tmp && $PY -m pytest "$REPO/tests/test_kernels_gpu.py" "$REPO/tests/test_gpu_engine.py" \
  "$REPO/tests/test_async.py" -m gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -25)

bench() { minivllm_bench "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -v "it/s\]" | tail -12; }
minivllm_bench() { $PY -m minivllm.cli bench "$@"; }

if [ "${1:-}" = "profile" ] || [ "${1:-}" = "all" ]; then
  $PY scripts/profile_steps.py 2>&1 | grep -v "it/s\]" | tee "$OUT/profile.log" | tail -120
fi

if [ -z "${1:-}" ] || [ "${1:-}" = "all" ]; then
  # Overlapped vs synchronous scheduling, one engine: tok/s and host ms per step each.
  bench throughput --compare hf --hf-num-seqs 16 --scheduling both
  bench latency --compare hf --batch-sizes 1 --repeats 3
  # minivllm serve against the same load in-process (needs the server's wheels).
  if $PY -c "import fastapi, uvicorn, httpx, prometheus_client" 2>/dev/null; then
    (cd /tmp && $PY -c "from minivllm.cli import main; main()" bench serve \
      --model Qwen/Qwen3-0.6B --load-format dummy --max-model-len 2048 --max-num-seqs 32 \
      --prompt-len 128 --output-len 256 --concurrency 1 8 32) 2>&1 \
      | tee "$OUT/bench-serve.log" | tail -14
  else
    echo "bench serve: skipped (fastapi/uvicorn/httpx/prometheus_client not installed)"
  fi
fi

echo
echo "== summary =="
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -2
grep -E "^  (throughput|host ms|decode|TTFT|transformers|ratio)" "$OUT/bench.log" || true
grep -E "^(server|frontend|engine) |^server / " "$OUT/bench-serve.log" 2>/dev/null || true
