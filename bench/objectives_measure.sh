#!/bin/bash
# bench/README.md, "Objectives on the demo" (issue 28): the demo drafter trained three ways
# on the same data, optimizer steps and schedule, seeds 42, 1, 2, the verifier in the step
# (--hidden-states-backend jax, fp32), each evaluated at its final step on the held-out
# conversations (original answers) and on the held-out prompts answered by the verifier:
#   baseline  the demo's --loss-fn '{"ce": 0.1, "tv": 0.9}', 2 epochs;
#   opd       the baseline's epoch-1 checkpoint resumed with --training-stage opd for
#             epoch 2 (Draft-OPD after a ce/tv warm-up; the same schedule continues);
#   dpard     --loss-fn renyi_half --per-position-loss-weight dpard --dpard-alpha 0.5.
# One process at a time, nice 10; reruns skip what is done. Then:
#   python bench/onpolicy_table.py --runs $RUNS/objectives
#   bench/objectives_measure.sh [PYTHON]   (RUNS, default runs; DATA: prepared demo rows)
# On other training data, e.g. the on-policy (regenerated) rows (Makefile, demo-onpolicy:
# runs/demo-onpolicy/conversations.jsonl, then launch.prepare_data without extraction):
#   DATA=runs/demo-onpolicy/data TAG=_onpolicy bench/objectives_measure.sh
# names the runs baseline_onpolicy_s42, dpard_onpolicy_s42, opd_onpolicy_s42, ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
RUNS=${RUNS:-runs}
R=$RUNS/objectives
V=configs/demo/verifier
DATA=${DATA:-$RUNS/demo-instep/data}
TAG=${TAG:-}
INSTEP=(--hidden-states-backend jax --verifier-dtype float32)
mkdir -p "$R"
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$R/progress.log"; }

prepare() {  # conversations output
  [ -f "$2/state.json" ] || nice -n 10 "$PY" -m launch.prepare_data --model $V --data "$1" \
    --output "$2" --seq-length 1024 --minimum-valid-tokens 16 > "$2.log" 2>&1
}
log start
[ -f "$DATA/state.json" ] || nice -n 10 make PY="$PY" "$DATA/state.json" > "$R/prep.log" 2>&1
prepare configs/demo/conversations_heldout.jsonl "$R/heldout"
[ -f "$RUNS/demo-onpolicy/conversations_heldout.jsonl" ] || nice -n 10 make PY="$PY" \
  runs/demo-onpolicy/conversations_heldout.jsonl > "$R/regenerate.log" 2>&1
prepare "$RUNS/demo-onpolicy/conversations_heldout.jsonl" "$R/heldout_onpolicy"
log "data ready"

train() {  # variant seed extra-flags...
  local d=$R/$1${TAG}_s$2 v=$1$TAG s=$2
  shift 2
  mkdir -p "$d"
  if [ ! -f "$d/checkpoints/training_complete" ]; then
    log "train ${v}_s$s"
    nice -n 10 "$PY" -m dspark_jax.train --config configs/demo/train.yaml "${INSTEP[@]}" \
      --data-path "$DATA" --seed "$s" "$@" --save-path "$d/checkpoints" --log-dir "$d/logs" \
      --run-name "${v}_s$s" > "$d.train.log" 2>&1
    touch "$d/checkpoints/training_complete"
  fi
}
evaluate() {  # run-folder name
  local d=$R/$1 set
  for set in heldout heldout_onpolicy; do
    [ -f "$d/eval_$set/summary.json" ] && continue
    log "eval $1 $set"
    nice -n 10 "$PY" -m dspark_jax.eval --checkpoint "$d/checkpoints" --step latest \
      --verifier $V --total-seq-len 1024 --dataset "$set=$R/$set" --output-dir "$d/eval_$set" \
      "${INSTEP[@]}" --hidden-states-dtype float32 --no-plots > "$d.eval_$set.log" 2>&1
  done
}
for s in 42 1 2; do
  train baseline $s
  evaluate "baseline${TAG}_s$s"
  d=$R/opd${TAG}_s$s
  if [ ! -d "$d/checkpoints" ]; then  # the warm-up: the baseline's first epoch
    mkdir -p "$d"
    cp -r "$R/baseline${TAG}_s$s/checkpoints" "$d/checkpoints"
    rm -f "$d/checkpoints/training_complete"
    last=$(ls "$d/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -1)
    rm -rf "${d:?}/checkpoints/$last"
  fi
  train opd $s --training-stage opd
  evaluate "opd${TAG}_s$s"
  train dpard $s --loss-fn renyi_half --per-position-loss-weight dpard --dpard-alpha 0.5
  evaluate "dpard${TAG}_s$s"
done
log finished
