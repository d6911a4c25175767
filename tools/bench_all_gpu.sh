#!/usr/bin/env bash
# Every benchmark of docs/BENCHMARKS.md on the device machine, in order, each under a time limit,
# results and logs under $OUT. Run from the repository root after the installs of ../shared/GPU.md
# (wheel sets a and b into /tmp/site; the SmolLM2 GGUF in /tmp/teacher only if GGUF is wanted):
#
#   bash tools/bench_all_gpu.sh                 # env gdn inference train train_ds stats
#   bash tools/bench_all_gpu.sh gdn inference   # a subset, e.g. split over two warm calls
#   BENCH_ARGS=--quick bash tools/bench_all_gpu.sh   # tiny sizes (checks this script on a CPU)
#
# Environment: OUT (default runs/bench), GGUF (SmolLM2 .gguf for the stats/calibration step;
# default /tmp/teacher/smollm2.gguf when present), BENCH_TOTAL_S (wall budget of the whole
# script, default 540 s; every step gets min(its limit, what is left)), LIMIT_<STEP> (seconds),
# ARGS_<STEP> (extra arguments of that step, e.g. ARGS_GDN="--heads 9x64"), BENCH_ARGS (all steps).
# Kernel caches: fla compiles and autotunes about a minute per new kernel shape. Triton's and
# TileLang's caches live in /tmp/kcache (kept while the machine stays warm); at the end they are
# packed into $OUT/kernel_cache.tgz.part-aa, -ab, ... (15 MiB pieces: the device returns files of
# at most 16 MiB). `cat kernel_cache.tgz.part-* | tar xzf - -C .kernel_cache` in the repository,
# then carry [".kernel_cache"]: they are restored here first and the compile time is gone.
# Files back from the device: at most 8. Each step writes its JSON/log/markdown to $RESULTS
# (default $OUT/../bench_results, outside $OUT) and $OUT/results.tgz is rebuilt after every step,
# so $OUT holds results.tgz, summary.md and the cache pieces only (a step killed at its limit
# still leaves its partial JSON in the bundle).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kcache/triton} TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/kcache/tilelang}
OUT=${OUT:-$PWD/runs/bench}
RESULTS=${RESULTS:-$(dirname "$OUT")/bench_results}
mkdir -p "$OUT" "$RESULTS" "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR"
GGUF=${GGUF:-/tmp/teacher/smollm2.gguf}
TOTAL=${BENCH_TOTAL_S:-540}
START=$(date +%s)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env gdn inference train train_ds stats)

if [ -d .kernel_cache ]; then
  [ -d .kernel_cache/triton ] && cp -rn .kernel_cache/triton/. "$TRITON_CACHE_DIR"/
  [ -d .kernel_cache/tilelang ] && cp -rn .kernel_cache/tilelang/. "$TILELANG_CACHE_DIR"/
  echo "restored kernel caches from .kernel_cache ($(du -sh .kernel_cache | cut -f1))"
fi

# bundle: $OUT/results.tgz <- everything in $RESULTS so far (written to a temp name, then renamed)
bundle() {
  tar czf "$OUT/.results.tgz.tmp" -C "$RESULTS" . && mv "$OUT/.results.tgz.tmp" "$OUT/results.tgz"
}

# run NAME LIMIT ARGS...: python ARGS --out $RESULTS/bench_NAME.json, log in $RESULTS/bench_NAME.log
run() {
  local name=$1 limit=$2; shift 2
  local var="LIMIT_${name^^}" extra="ARGS_${name^^}"; limit=${!var:-$limit}
  local left=$(( TOTAL - ($(date +%s) - START) - 10 ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "=== $name: skipped (wall budget BENCH_TOTAL_S=$TOTAL spent)" | tee -a "$RESULTS/steps.txt"; return; fi
  echo "=== $name (limit ${limit}s): python $* ${!extra:-} ${BENCH_ARGS:-}"
  local t0=$(date +%s)
  timeout -k 10 "$limit" python "$@" ${!extra:-} ${BENCH_ARGS:-} --out "$RESULTS/bench_$name.json" > "$RESULTS/bench_$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s$( ((rc==124||rc==137)) && echo ' (TIME LIMIT: partial results in the JSON)')" | tee -a "$RESULTS/steps.txt"
  if [ -f "$RESULTS/bench_$name.md" ] && (( rc == 0 )); then :; else tail -n 15 "$RESULTS/bench_$name.log"; fi
  bundle
}

for step in "${steps[@]}"; do
  case $step in
    env)
      { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
        python - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
for m in ("triton", "fla", "tilelang", "deepspeed", "megatron.core", "transformers", "gguf"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__, str(e)[:100])
PY
      } 2>&1 | tee "$RESULTS/env.txt"; bundle ;;
    gdn)       run gdn 240 tools/bench_gdn.py ;;
    inference) run inference 200 tools/bench_inference.py ;;
    train)     run train 150 tools/bench_train.py --profile ;;
    train_ds)  run train_ds 120 tools/bench_train.py --deepspeed ;;
    stats)     if [ -f "$GGUF" ]; then run stats 180 tools/bench_stats.py --gguf "$GGUF"; else run stats 180 tools/bench_stats.py; fi ;;
    *) echo "unknown step $step (env gdn inference train train_ds stats)"; exit 2 ;;
  esac
done

rm -f "$OUT"/kernel_cache.tgz.part-*
tar czf - -C /tmp/kcache triton tilelang 2>/dev/null | split -b 15m - "$OUT/kernel_cache.tgz.part-" \
  && echo "kernel caches: $(ls "$OUT"/kernel_cache.tgz.part-* | wc -l) piece(s), $(cat "$OUT"/kernel_cache.tgz.part-* | wc -c) bytes"
echo "total wall: $(( $(date +%s) - START ))s"
python -m megatron_tc.bench.summary "$RESULTS" | tee "$OUT/summary.md"
bundle
