#!/bin/bash
# bench/README.md, "In-step verifier": the demo end to end with the verifier in the step
# (prepare + train) against the demo from files (prepare + extract + train), back to back
# on one machine at seed 1, then the in-step drafter at seed 2; both in-step seeds
# evaluated on the held-out set with the same backend (the file runs' seeds are the
# baseline rows of "On-policy data and per-document anchors").
#   bench/instep_measure.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
V=configs/demo/verifier
R=runs/instep_bench
mkdir -p $R
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a $R/progress.log; }
timed() {  # name command... : wall time and peak RSS in $R/name.time
  local name=$1; shift
  /usr/bin/time -v -o $R/$name.time "$@" > $R/$name.log 2>&1
  log "$name: $(grep -E 'Elapsed|Maximum resident' $R/$name.time | tr -s ' ' | tr '\n' ';')"
}
prepare() {  # output-folder conversations [extra]
  $PY -m launch.prepare_data --model $V --data $2 --output $1 --seq-length 1024 \
    --minimum-valid-tokens 16 "${@:3}"
}
train() {  # run-folder data seed [extra]
  $PY -m dspark_jax.train --config configs/demo/train.yaml --data-path $2 --seed $3 \
    --save-path $1/checkpoints --log-dir $1/logs --run-name $(basename $1) "${@:4}"
}
INSTEP=(--hidden-states-backend jax --verifier-dtype float32)
export -f prepare train; export PY V
log start
# 1. in-step, end to end: prepare + train (seed 1)
timed instep_e2e_s1 bash -c "prepare $R/instep/data configs/demo/conversations.jsonl \
  --draft-vocab-size 2048 && train $R/instep_s1 $R/instep/data 1 ${INSTEP[*]}"
# 2. from files, end to end: prepare + extract + train (seed 1)
timed files_e2e_s1 bash -c "prepare $R/files/data configs/demo/conversations.jsonl \
  --draft-vocab-size 2048 && $PY -m launch.extract_hidden_states --backend hf --model $V \
  --preprocessed-data $R/files/data --target-layer-ids 1 2 3 && train $R/files_s1 $R/files/data 1"
# 3. in-step, seed 2 (data of step 1)
timed instep_s2 bash -c "train $R/instep_s2 $R/instep/data 2 ${INSTEP[*]}"
# 4. held-out evaluation of the in-step drafters, hidden states computed in the step
prepare $R/instep/heldout configs/demo/conversations_heldout.jsonl > $R/heldout_prepare.log 2>&1
for s in 1 2; do
  timed eval_instep_s$s $PY -m dspark_jax.eval --checkpoint $R/instep_s$s/checkpoints \
    --step latest --verifier $V --total-seq-len 1024 --dataset heldout=$R/instep/heldout \
    --no-plots --output-dir $R/instep_s$s/eval "${INSTEP[@]}" --hidden-states-dtype float32
done
log finished
