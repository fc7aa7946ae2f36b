#!/usr/bin/env bash
# Long-run parity: correct layouts, and a bug that starts in the last 5% of the run, trained for
# STEPS steps and judged against cp=1 with the noise twin and the anchored check.
#   bash scripts/long_parity.sh 500 outputs/long500
#   bash scripts/long_parity.sh 2000 outputs/long2000 cp2 late_rank_local_loss   # a subset
# Each run goes to OUT/NAME (reused when its metrics already reach STEPS); the reports are
# OUT/report_{mtp_on,mtp_off,vision}.md, each table stating every run's margin.
set -euo pipefail
STEPS=${1:?usage: long_parity.sh STEPS OUT [NAME...]}
OUT=${2:?usage: long_parity.sh STEPS OUT [NAME...]}
shift 2
PY=${PYTHON:-.venv/bin/python}
ONSET=$((STEPS - STEPS / 20 + 1))
BASE=(experiment=training_mutants "trainer.max_steps=$STEPS")
VISION=(experiment=vision_cp mtp=on "trainer.max_steps=$STEPS" compare.noise_floor=twin)
declare -A RUNS=(
  [cp1]="${BASE[*]} cp=1"
  [cp2]="${BASE[*]} cp=2"
  [cp4]="${BASE[*]} cp=4"
  [cp8]="${BASE[*]} cp=8"
  [dp2_cp2]="${BASE[*]} cp=2 parallel.dp=2"
  [tp2]="${BASE[*]} parallel.tp=2"
  [tp2_sp_cp2]="${BASE[*]} cp=2 parallel.tp=2 parallel.sequence_parallel=true"
  [pp2_cp2]="${BASE[*]} cp=2 parallel.pp=2"
  [reference_cp2]="${BASE[*]} cp=2 trainer.engine=reference"
  [late_rank_local_loss]="${BASE[*]} cp=2 mutant.name=rank_local_loss mutant.onset=$ONSET"
  [mtp_off_cp1]="${BASE[*]} mtp=off cp=1"
  [mtp_off_cp2]="${BASE[*]} mtp=off cp=2"
  [vision_cp1]="${VISION[*]} cp=1"
  [vision_cp2]="${VISION[*]} cp=2"
)
ORDER=(cp1 cp2 late_rank_local_loss cp4 dp2_cp2 tp2 tp2_sp_cp2 pp2_cp2 reference_cp2 mtp_off_cp1
  mtp_off_cp2 vision_cp1 vision_cp2 cp8)
[[ $# -gt 0 ]] && ORDER=("$@")
mkdir -p "$OUT"
for name in "${ORDER[@]}"; do
  dir="$OUT/$name"
  if [[ -f $dir/metrics.jsonl ]] && grep -q "\"step\": $STEPS[,}]" "$dir/metrics.jsonl"; then
    echo "== $name: done before"
    continue
  fi
  echo "== $name: ${RUNS[$name]}"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$PY" train.py ${RUNS[$name]} "hydra.run.dir=$dir" > "$OUT/$name.log" 2>&1 || echo "   exit $?"
  echo "   $(( $(date +%s) - start )) s"
done
judge() {  # REPORT BASELINE RUN...
  local report=$1 baseline=$2
  shift 2
  local runs=()
  for r in "$@"; do [[ -d $OUT/$r ]] && runs+=("$OUT/$r"); done
  [[ -d $OUT/$baseline && ${#runs[@]} -gt 0 ]] || return 0
  echo "== judge $report"
  start=$(date +%s)
  "$PY" -m recipe.compare "${runs[@]}" --baseline "$OUT/$baseline" --noise-floor twin \
    --report "$OUT/$report" > "$OUT/$report.log" 2>&1 || echo "   exit $?"
  echo "   $(( $(date +%s) - start )) s"
  tail -n 30 "$OUT/$report.log"
}
judge report_mtp_on.md cp1 cp2 cp4 cp8 dp2_cp2 tp2 tp2_sp_cp2 pp2_cp2 reference_cp2 late_rank_local_loss
judge report_mtp_off.md mtp_off_cp1 mtp_off_cp2
judge report_vision.md vision_cp1 vision_cp2
