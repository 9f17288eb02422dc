#!/bin/bash
# bench/README.md, "In-step verifier" (issue 42): the demo drafter from files (prepare +
# extract + train) against the verifier in the step (prepare + train), side by side on
# one otherwise idle machine: runs alternate A B B A (files, in-step, in-step, files) so
# a drift in load or clock hits both alike. Each stage is timed on its own; one JSON line
# per run (stage seconds, total, load average at the start) goes to $R/runs.jsonl and
# stdout.
#   bench/instep_vs_files.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
V=configs/demo/verifier
R=${OUT:-runs/instep_vs_files}
rm -rf "$R"; mkdir -p "$R"
stage() {  # run name command... : seconds of the stage (log in $R/<run>.<name>.log)
  local run=$1 name=$2; shift 2
  local t0; t0=$(date +%s.%N)
  "$@" > "$R/$run.$name.log" 2>&1
  python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)"
}
one() {  # run kind(files|instep)
  local run=$1 kind=$2 data=$R/$1/data load prep ext=0 train
  load=$(cut -d' ' -f1 /proc/loadavg)
  prep=$(stage "$run" prepare "$PY" -m launch.prepare_data --model $V \
    --data configs/demo/conversations.jsonl --output "$data" --seq-length 1024 \
    --minimum-valid-tokens 16 --draft-vocab-size 2048)
  local extra=()
  if [ "$kind" = files ]; then
    ext=$(stage "$run" extract "$PY" -m launch.extract_hidden_states --backend hf --model $V \
      --preprocessed-data "$data" --target-layer-ids 1 2 3)
  else
    extra=(--hidden-states-backend jax --verifier-dtype float32)
  fi
  train=$(stage "$run" train "$PY" -m dspark_jax.train --config configs/demo/train.yaml \
    --data-path "$data" --save-path "$R/$run/checkpoints" --log-dir "$R/$run/logs" \
    --run-name "$run" "${extra[@]}")
  python3 -c "import json, sys; r, k, l, p, e, t = sys.argv[1:]; print(json.dumps({'bench': 'instep_vs_files', 'run': r, 'kind': k, 'load_at_start': float(l), 'prepare_s': float(p), 'extract_s': float(e), 'train_s': float(t), 'total_s': round(float(p) + float(e) + float(t), 1)}))" \
    "$run" "$kind" "$load" "$prep" "$ext" "$train" | tee -a "$R/runs.jsonl"
}
one files_1 files
one instep_1 instep
one instep_2 instep
one files_2 files
du -sh "$R"/files_1/data/hidden_states | sed 's/^/hidden-state files of one run: /'
