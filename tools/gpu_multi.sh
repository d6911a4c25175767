#!/usr/bin/env bash
# Multi-GPU validation (issue 12) on one host with several GPUs, in order, each step under a time
# limit, logs and results under $OUT. Run from the repository root after the wheel installs of
# ../shared/GPU.md (sets a and b into /tmp/site), with .gpudata/ carried
# (`python tools/prepare_gpu_smoke.py` writes it here) and, when there is one, .kernel_cache/:
#
#   bash tools/gpu_multi.sh                  # nccl scaling smoke (GPU_TOTAL_S=900: more than one device call)
#   bash tools/gpu_multi.sh scaling smoke    # a subset
#
#   nccl     python -m pytest -q -s tests/gpu/test_comm_nccl.py tests/gpu/test_parallel_nccl.py (skipped when absent)
#   scaling  tools/bench_scaling.py: ZeRO-3 distillation step of llama-1b at N = 1, 2, 4, ... GPUs
#   smoke    bash launch/distill.sh configs/gpu_smoke.yaml over every local GPU (deepspeed
#            launcher, NCCL, bf16, fla), then tools/check_smoke_run.py on the run
#
# Environment: OUT (default runs/gpu_multi), GPU_TOTAL_S (wall budget of the whole script, default
# 540 s; every step gets min(its limit, what is left)), LIMIT_NCCL / LIMIT_SCALING / LIMIT_SMOKE
# (seconds: 300 / 230 / 300; on 2026-11-29 the NCCL tests took 70-90 s each, the smoke run 283 s),
# ARGS_NCCL / ARGS_SCALING / ARGS_SMOKE (extra arguments), SCALING_PER_N_S (limit of one N of the
# scaling bench, default 190: the first N compiles fla). Kernel caches as in tools/bench_all_gpu.sh:
# /tmp/kcache (restored from .kernel_cache/ when carried), packed at the end into
# $OUT/kernel_cache.tgz.part-* (15 MiB pieces). Files back from the device: at most 8, so every log
# and result goes to $RESULTS (default $OUT/../gpu_multi_results) and $OUT/results.tgz is rebuilt
# after every step; $OUT/summary.md holds the headline lines.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off in everything this script starts (shared GPU hosts)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kcache/triton} TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/kcache/tilelang}
OUT=${OUT:-$PWD/runs/gpu_multi}
RESULTS=${RESULTS:-$(dirname "$OUT")/gpu_multi_results}
SMOKE_RUN=${SMOKE_RUN:-/tmp/gpu_smoke_run}
mkdir -p "$OUT" "$RESULTS" "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR"
TOTAL=${GPU_TOTAL_S:-540}
START=$(date +%s)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(nccl scaling smoke)
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "gpu_multi: $NGPU GPU(s), steps: ${steps[*]}, budget ${TOTAL}s" | tee "$RESULTS/steps.txt"

if [ -d .kernel_cache ]; then
  [ -d .kernel_cache/triton ] && cp -rn .kernel_cache/triton/. "$TRITON_CACHE_DIR"/
  [ -d .kernel_cache/tilelang ] && cp -rn .kernel_cache/tilelang/. "$TILELANG_CACHE_DIR"/
  echo "restored kernel caches from .kernel_cache ($(du -sh .kernel_cache | cut -f1))" | tee -a "$RESULTS/steps.txt"
fi

bundle() {
  tar czf "$OUT/.results.tgz.tmp" -C "$RESULTS" . && mv "$OUT/.results.tgz.tmp" "$OUT/results.tgz"
}

# limit_for NAME DEFAULT -> seconds this step may run (0: budget spent)
limit_for() {
  local var="LIMIT_${1^^}" limit
  limit=${!var:-$2}
  local left=$(( TOTAL - ($(date +%s) - START) - 10 ))
  (( left < limit )) && limit=$left
  (( limit < 20 )) && limit=0
  echo "$limit"
}

# step NAME LIMIT CMD...: CMD under `timeout`, output in $RESULTS/NAME.log
step() {
  local name=$1 limit=$2; shift 2
  if (( limit == 0 )); then echo "=== $name: skipped (wall budget GPU_TOTAL_S=$TOTAL spent)" | tee -a "$RESULTS/steps.txt"; return 1; fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$RESULTS/steps.txt"
  local t0=$(date +%s)
  timeout -k 15 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s$( ((rc==124||rc==137)) && echo ' (TIME LIMIT)')" | tee -a "$RESULTS/steps.txt"
  tail -n 20 "$RESULTS/$name.log"
  bundle
  return $rc
}

{ date -u; nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; nvidia-smi topo -m
  python - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for m in ("triton", "fla", "tilelang", "deepspeed", "megatron.core", "transformers"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__, str(e)[:100])
PY
} > "$RESULTS/env.txt" 2>&1
head -n 3 "$RESULTS/env.txt"; bundle

for s in "${steps[@]}"; do
  case $s in
    nccl)
      if [ -f tests/gpu/test_parallel_nccl.py ]; then
        # test_comm_nccl first (~30 s): collectives on CPU tensors and the stats pass on GPUs over NCCL
        step nccl "$(limit_for nccl 300)" python -m pytest -q -s tests/gpu/test_comm_nccl.py tests/gpu/test_parallel_nccl.py ${ARGS_NCCL:-}
      else
        echo "=== nccl: skipped (tests/gpu/test_parallel_nccl.py absent)" | tee -a "$RESULTS/steps.txt"
      fi ;;
    scaling)
      step scaling "$(limit_for scaling 230)" python tools/bench_scaling.py --out "$RESULTS/bench_scaling.json" \
        --timeout "${SCALING_PER_N_S:-190}" ${ARGS_SCALING:-} ;;
    smoke)
      if [ ! -f .gpudata/teacher/config.json ]; then
        echo "=== smoke: skipped (.gpudata/ missing: run python tools/prepare_gpu_smoke.py here and carry .gpudata)" | tee -a "$RESULTS/steps.txt"
        continue
      fi
      chmod +x launch/distill.sh  # the deepspeed launcher executes it directly (--no_python)
      bash launch/distill.sh --print-env > "$RESULTS/smoke_print_env.txt" 2>&1
      rm -rf "$SMOKE_RUN"; touch /tmp/gpu_multi_smoke_marker
      step smoke "$(limit_for smoke 300)" bash launch/distill.sh configs/gpu_smoke.yaml "run.run_dir=$SMOKE_RUN" ${ARGS_SMOKE:-}
      mkdir -p "$RESULTS/smoke_run"
      for f in manifest.json config.yaml run.json eval_log.jsonl stage1/train_log.jsonl stage2/train_log.jsonl eval/results.json; do
        [ -f "$SMOKE_RUN/$f" ] && cp "$SMOKE_RUN/$f" "$RESULTS/smoke_run/${f//\//_}"
      done
      if (( NGPU > 0 )); then check=(--world "$NGPU" --precision bf16 --cuda --kernels-since /tmp/gpu_multi_smoke_marker)
      else check=(--world "${NPROC:-2}" --precision fp32); fi  # a CPU dry run (gloo ranks)
      python tools/check_smoke_run.py "$SMOKE_RUN" --log "$RESULTS/smoke.log" "${check[@]}" 2>&1 | tee "$RESULTS/smoke_check.txt"
      bundle ;;
    *) echo "unknown step $s (nccl scaling smoke)"; exit 2 ;;
  esac
done

rm -f "$OUT"/kernel_cache.tgz.part-*
tar czf - -C /tmp/kcache triton tilelang 2>/dev/null | split -b 15m - "$OUT/kernel_cache.tgz.part-" \
  && echo "kernel caches: $(ls "$OUT"/kernel_cache.tgz.part-* | wc -l) piece(s), $(cat "$OUT"/kernel_cache.tgz.part-* | wc -c) bytes"
{ echo "# gpu_multi ($NGPU GPUs, $(date -u '+%Y-%m-%d %H:%M UTC'), total $(( $(date +%s) - START ))s)"; echo
  echo '```'; cat "$RESULTS/steps.txt"; echo '```'
  [ -f "$RESULTS/nccl.log" ] && { echo; echo "## nccl (last lines)"; echo '```'; tail -n 15 "$RESULTS/nccl.log"; echo '```'; }
  [ -f "$RESULTS/bench_scaling.md" ] && { echo; cat "$RESULTS/bench_scaling.md"; }
  [ -f "$RESULTS/smoke_check.txt" ] && { echo; echo "## smoke"; echo '```'; cat "$RESULTS/smoke_check.txt"; echo '```'; }
} > "$OUT/summary.md"
cat "$OUT/summary.md"
bundle
