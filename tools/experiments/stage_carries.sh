#!/usr/bin/env bash
# Before a session's first device call (issue 10 on SmolLM2): arrange what the calls carry so that each
# fits the 64 MiB carry limit (67,108,864 bytes, the tracked tree included), and print each call's size.
#
#   bash tools/experiments/stage_carries.sh
#
# The wheel sets of ../shared/gpu/fetch_wheels.sh (.gpuwheels/a 59.5 MB, b 32.9 MB) no longer fit beside
# the tree (8.9 MB by the sixteenth session: committed results), so this moves tilelang into a set of its
# own (.gpuwheels/t) and the two small wheels of b into a, leaving z3 alone in b (idempotent). It also
# rebuilds .paper_runs/runs from every committed docs/bench/*/paper_results/runs (what `restore` unpacks
# on the device, so finished cells are skipped and their selections linked). Install each set with
# `paper_grid_gpu.sh install_<set>`; docs/BENCHMARKS.md, "What the next session should run first".
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=67108864
W=.gpuwheels
for need in "$W/a" "$W/b" .teacher/t1 .teacher/t2 .teacher/t3 .teacher/t4 .paper_data.tgz; do
  [ -e "$need" ] || { echo "missing $need: run ../shared/gpu/fetch_wheels.sh $W, ../shared/gpu/stage_teacher.sh" \
    ".teacher and python tools/experiments/paper_data.py first" >&2; exit 1; }
done
mkdir -p "$W/t"
mv -n "$W"/a/tilelang-*.whl "$W/t/" 2>/dev/null || true
mv -n "$W"/b/apache_tvm_ffi-*.whl "$W"/b/torch_c_dlpack_ext-*.whl "$W/a/" 2>/dev/null || true
rm -rf .paper_runs/runs && mkdir -p .paper_runs/runs
for d in docs/bench/*/paper_results/runs; do  # sessions in date order: a later cell replaces an earlier one whole
  for cell in "$d"/grid/*/*/*/*/; do  # (file by file, an earlier session's manifest.json would stay beside it)
    [ -d "$cell" ] && rm -rf ".paper_runs/runs/${cell#"$d"/}"
  done
  cp -r "$d/." .paper_runs/runs/
done

tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
status=0
check() {  # check NAME PATH...: the call's carry plus the tree against the limit
  local name=$1; shift
  local bytes=$(( $(du -scb "$@" | tail -1 | cut -f1) + tree ))
  local verdict=ok; [ "$bytes" -le "$LIMIT" ] || { verdict="OVER the limit"; status=1; }
  printf '%-8s %-48s %10d bytes (%d left): %s\n' "$name" "$*" "$bytes" $(( LIMIT - bytes )) "$verdict"
}
echo "tracked tree: $tree bytes"
check "call 1" "$W/t" .paper_data.tgz
check "call 2" "$W/a" .teacher/t1 .paper_runs/runs
check "call 3" "$W/b" .teacher/t2
check "call 4" .teacher/t3 .teacher/t4
exit $status
