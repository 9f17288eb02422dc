#!/bin/bash
# bench/README.md, "D-PARD on the demo": the demo drafter trained with D-PARD and with
# the demo's ce/tv loss on the original demo data (seeds 42, 1, 2; same config, data and
# optimizer steps), each evaluated at its final step on the held-out conversations
# (original answers) and on the held-out prompts answered by the verifier. One process at
# a time, nice 10. Then: python bench/onpolicy_table.py --runs runs/dpard_bench
#   bench/dpard_measure.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
R=runs/dpard_bench
mkdir -p $R
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a $R/progress.log; }
log start
nice -n 10 make PY=$PY runs/demo/data/hidden_states/extraction_config.json \
  runs/demo/heldout/hidden_states/extraction_config.json > $R/prep.log 2>&1
log "demo data and held-out set ready"
evaluate() {  # run-folder name dataset=path
  nice -n 10 $PY -m dspark_jax.eval --checkpoint $1/checkpoints --step latest \
    --verifier configs/demo/verifier --total-seq-len 1024 --dataset $3 \
    --output-dir $1/eval_$2 > $1.eval_$2.log 2>&1
}
train() {  # variant seed extra-flags...
  local v=$1 s=$2; shift 2
  local d=$R/${v}_s$s
  if [ ! -f $d/checkpoints/training_complete ]; then
    log "train ${v}_s$s"
    nice -n 10 $PY -m dspark_jax.train --config configs/demo/train.yaml --seed $s "$@" \
      --save-path $d/checkpoints --log-dir $d/logs --run-name ${v}_s$s > $d.train.log 2>&1
    touch $d/checkpoints/training_complete
  fi
  [ -f $d/eval_heldout/summary.json ] || { log "eval ${v}_s$s heldout"; evaluate $d heldout heldout=runs/demo/heldout; }
  log "done ${v}_s$s (original answers)"
}
DPARD=(--loss-fn renyi_half --per-position-loss-weight dpard --dpard-alpha 0.5)
train dpard 42 "${DPARD[@]}"
train baseline 42
# The held-out prompts answered by the verifier (Makefile, demo-onpolicy).
nice -n 10 make PY=$PY runs/demo-onpolicy/heldout/hidden_states/extraction_config.json \
  > $R/prep_onpolicy.log 2>&1
log "held-out prompts answered by the verifier ready"
for s in 42 1 2; do
  [ $s = 42 ] || train dpard $s "${DPARD[@]}"
  [ $s = 42 ] || train baseline $s
  for v in dpard baseline; do
    d=$R/${v}_s$s
    [ -f $d/eval_heldout_onpolicy/summary.json ] || {
      log "eval ${v}_s$s heldout_onpolicy"
      evaluate $d heldout_onpolicy heldout_onpolicy=runs/demo-onpolicy/heldout
    }
  done
done
log finished
