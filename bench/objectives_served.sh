#!/bin/bash
# bench/README.md, "Objectives judged by served acceptance" (issue 44): the demo drafter
# trained several ways on the same rows, the verifier in the step (fp32), each judged by
# the served-equivalent greedy acceptance (python -m dspark_jax.eval's served walk, vLLM's
# rules) on the held-out prompts answered greedily by the verifier, beside the evaluator's
# free-running and teacher-forced figures on them and on the original answers:
#   baseline     the demo's --loss-fn '{"ce": 0.1, "tv": 0.9}', 2 epochs (one cosine);
#   opd_tail     the baseline's epoch-1 checkpoint resumed with --training-stage opd for
#                epoch 2 (issue 28's Draft-OPD: the tail of the same schedule);
#   sft1         1 epoch ce/tv with its own cosine (the paper's SFT stage, scaled);
#   opd          sft1 then --from-pretrained it, --training-stage opd for 1 epoch at a
#                fresh learning rate and schedule (the paper's shape: as many optimizer
#                steps in all as the baseline), greedy drafting;
#   opd_sampled  the same, --opd-drafting sampled;
#   opd_lr<LR>   opd with the OPD stage at --lr LR (the paper's OPD runs at a fresh 3e-4);
#   dpard_a<A>   --loss-fn renyi_half --per-position-loss-weight dpard --dpard-alpha A.
# Seed 42 runs VARIANTS (default: baseline, opd, opd_sampled, dpard_a0.5, dpard_a0.25);
# SEEDS (default none) run VARIANTS_MORE (default: baseline opd dpard_a0.5). Each is
# evaluated on the greedy answers only (the served walk needs them; ORIGINAL=1 adds the
# original answers). One process at a time, nice 10; reruns skip what is done.
#   bench/objectives_served.sh [PYTHON]; then python bench/objectives_served_table.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
RUNS=${RUNS:-runs}
R=$RUNS/objectives_served
V=configs/demo/verifier
DATA=$RUNS/demo-instep/data
VARIANTS=${VARIANTS:-"baseline opd opd_sampled dpard_a0.5 dpard_a0.25"}
SEEDS=${SEEDS:-}
VARIANTS_MORE=${VARIANTS_MORE:-"baseline opd dpard_a0.5"}
INSTEP=(--hidden-states-backend jax --verifier-dtype float32)
mkdir -p "$R"
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$R/progress.log"; }

prepare() {  # conversations output
  [ -f "$2/state.json" ] || nice -n 10 "$PY" -m launch.prepare_data --model $V --data "$1" \
    --output "$2" --seq-length 1024 --minimum-valid-tokens 16 > "$2.log" 2>&1
}
log start
[ -f "$DATA/state.json" ] || nice -n 10 make PY="$PY" "$DATA/state.json" > "$R/prep.log" 2>&1
# The held-out prompts answered greedily by the verifier (fp32, HF): what a greedy engine
# serves, so the served walk over them is exact up to vLLM's past-the-end counts.
G=$R/conversations_heldout_greedy.jsonl
[ -f "$G" ] || nice -n 10 "$PY" -m launch.regenerate --backend hf --model $V \
  --data configs/demo/conversations_heldout.jsonl --output "$G" --temperature 0 \
  --max-new-tokens 512 --batch-size 256 --chunk-size 512 > "$R/regenerate.log" 2>&1
prepare "$G" "$R/heldout_greedy"
SETS=(--dataset "heldout_greedy=$R/heldout_greedy")
if [ -n "${ORIGINAL:-}" ]; then
  prepare configs/demo/conversations_heldout.jsonl "$R/heldout"
  SETS+=(--dataset "heldout=$R/heldout")
fi
log "data ready"

# The OPD stage starts from the SFT stage's drafter (--from-pretrained), which defines the
# model: the demo config without its decoder-shaping key.
grep -v '^    num_layers:' configs/demo/train.yaml > "$R/train_from_pretrained.yaml"

train() {  # run extra-flags...
  local d=$R/$1 config=configs/demo/train.yaml
  shift
  [[ " $* " == *" --from-pretrained "* ]] && config=$R/train_from_pretrained.yaml
  mkdir -p "$d"
  if [ ! -f "$d/checkpoints/training_complete" ]; then
    log "train $(basename "$d")"
    nice -n 10 "$PY" -m dspark_jax.train --config "$config" "${INSTEP[@]}" \
      --data-path "$DATA" "$@" --save-path "$d/checkpoints" --log-dir "$d/logs" \
      --run-name "$(basename "$d")" > "$d.train.log" 2>&1
    touch "$d/checkpoints/training_complete"
  fi
}
evaluate() {  # run
  local d=$R/$1
  [ -f "$d/eval/summary.json" ] && return
  log "eval $1"
  nice -n 10 "$PY" -m dspark_jax.eval --checkpoint "$d/checkpoints" --step latest \
    --verifier $V --total-seq-len 1024 "${SETS[@]}" --output-dir "$d/eval" "${INSTEP[@]}" \
    --hidden-states-dtype float32 --no-plots > "$d.eval.log" 2>&1
}
variant() {  # name seed
  local v=$1 s=$2 run=${1}_s$2
  case $v in
    baseline) train "$run" --seed "$s" ;;
    sft1) train "$run" --seed "$s" --epochs 1; return ;;  # a stage, not judged
    opd | opd_sampled | opd_lr*)
      variant sft1 "$s"
      local extra=(--opd-drafting greedy)
      [ "$v" = opd_sampled ] && extra=(--opd-drafting sampled)
      [[ $v == opd_lr* ]] && extra+=(--lr "${v#opd_lr}")
      train "$run" --seed "$s" --epochs 1 --from-pretrained "$R/sft1_s$s/checkpoints" \
        --training-stage opd "${extra[@]}" ;;
    opd_tail)
      variant baseline "$s"
      local d=$R/$run
      if [ ! -d "$d/checkpoints" ]; then  # the warm-up: the baseline's first epoch
        mkdir -p "$d"
        cp -r "$R/baseline_s$s/checkpoints" "$d/checkpoints"
        rm -f "$d/checkpoints/training_complete"
        local last
        last=$(ls "$d/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -1)
        rm -rf "${d:?}/checkpoints/$last"
      fi
      train "$run" --seed "$s" --training-stage opd ;;
    dpard_a*)
      train "$run" --seed "$s" --loss-fn renyi_half --per-position-loss-weight dpard \
        --dpard-alpha "${v#dpard_a}" ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  evaluate "$run"
}
for v in $VARIANTS; do variant "$v" 42; done
for s in $SEEDS; do
  for v in $VARIANTS_MORE; do variant "$v" "$s"; done
done
log finished
