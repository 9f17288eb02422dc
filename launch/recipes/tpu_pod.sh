#!/usr/bin/env bash
# Train a DSpark drafter on every worker of a Cloud TPU VM slice, with hidden states from a
# vLLM extractor running elsewhere (e.g. slurm_dspark.sbatch with EXTRACT_ONLY=1 on a GPU
# cluster). Run it from the repository root on a machine with gcloud access to the TPU:
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a VLLM_ENDPOINT=http://gpu-head:8000/v1 \
#   MOONCAKE_MASTER=gpu-head:50051 MODEL=/mnt/models/Kimi-K3 DATA_PATH=/mnt/runs/k3/data \
#     bash launch/recipes/tpu_pod.sh
#
# Steps: (SETUP=1) clone + install the repository on every worker; wait until the
# extractor's /health answers 200 (from this machine); then one
# `gcloud compute tpus tpu-vm ssh --worker=all` runs python -m dspark_jax.train on all
# workers at once, one process per worker (jax.distributed, coordinator on worker 0).
# DRY_RUN=1 prints the commands instead. Settings: launch/recipes/README.md.

set -euo pipefail
RECIPE=tpu_pod
REPO_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
# On the workers the trainer runs from REMOTE_DIR, in the venv SETUP=1 creates there.
: "${TRAIN_PYTHON:=.venv/bin/python}"
# shellcheck source=launch/recipes/common.sh
source "$REPO_DIR/launch/recipes/common.sh"

: "${DRY_RUN:=0}"
: "${SETUP:=0}"
: "${PROJECT:=}"
: "${REMOTE_DIR:=dspark-jax}"
: "${REPO_REF:=main}"
: "${SETUP_PYTHON:=python3}"
# JAX's TPU wheel matching the pinned jax (pyproject.toml has no TPU extra).
if [[ -z "${JAX_TPU_SPEC:-}" ]]; then
  jax_pin=$(sed -n 's/^ *"jax==\([^"]*\)",*$/\1/p' "$REPO_DIR/pyproject.toml")
  [[ -n "$jax_pin" ]] || die "no jax== pin found in $REPO_DIR/pyproject.toml; set JAX_TPU_SPEC"
  JAX_TPU_SPEC="jax[tpu]==$jax_pin"
fi

require_flag DRY_RUN SETUP
require TPU_NAME ZONE VLLM_ENDPOINT
check_common
if [[ "$TRANSPORT" == mooncake ]]; then
  require MOONCAKE_MASTER
fi
if [[ "$SETUP" == 1 && -z "${SETUP_CMD:-}" ]]; then
  require REPO_URL
fi
[[ "$VLLM_ENDPOINT" =~ ^https?://[^/]+(/v1)?/?$ ]] ||
  die "VLLM_ENDPOINT must look like http://HOST:PORT/v1, got '$VLLM_ENDPOINT'"
VLLM_ENDPOINT=${VLLM_ENDPOINT%/}
HEALTH_URL="${VLLM_ENDPOINT%/v1}/health"

GCLOUD_FLAGS=(--zone "$ZONE")
if [[ -n "$PROJECT" ]]; then
  GCLOUD_FLAGS+=(--project "$PROJECT")
fi
SSH_ALL=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_FLAGS[@]}" --worker=all --command)

# run LABEL COMMAND...: print it (dry run) or run it in the foreground.
run() {
  local label=$1
  shift
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "[$label] $(shell_join "$@")"
  else
    log "running: $(shell_join "$@")"
    "$@"
  fi
}

if [[ "$DRY_RUN" == 1 ]]; then
  echo "# $RECIPE dry run: TPU $TPU_NAME (zone $ZONE), extractor $VLLM_ENDPOINT, TRANSPORT=$TRANSPORT"
fi

# 1. Optional setup on every worker: clone (or update) the repository into REMOTE_DIR and
#    install it with the TPU jaxlib. SETUP_CMD replaces the whole command.
if [[ "$SETUP" == 1 ]]; then
  if [[ -z "${SETUP_CMD:-}" ]]; then
    extras=""
    if [[ "$TRANSPORT" == mooncake ]]; then
      extras="[mooncake-cpu]"
    fi
    dir=$(shell_join "$REMOTE_DIR")
    SETUP_CMD="set -e; if [ ! -d $dir/.git ]; then git clone $(shell_join "$REPO_URL") $dir; fi"
    SETUP_CMD+="; cd $dir && git fetch origin $(shell_join "$REPO_REF") && git checkout --detach FETCH_HEAD"
    SETUP_CMD+="; $(shell_join "$SETUP_PYTHON") -m venv .venv"
    SETUP_CMD+="; .venv/bin/pip install -e $(shell_join ".$extras" "$JAX_TPU_SPEC")"
  fi
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "[tpu worker all setup] $SETUP_CMD"
  fi
  run local "${SSH_ALL[@]}" "$SETUP_CMD"
fi

# 2. The extractor must be serving before the trainer asks it for hidden states.
if [[ "$DRY_RUN" == 1 ]]; then
  echo "[local] wait until GET $HEALTH_URL answers 200 (curl every ${HEALTH_INTERVAL}s, fail after ${HEALTH_TIMEOUT}s)"
else
  command -v curl >/dev/null || die "curl not found (needed to wait for the extractor)"
  wait_http "$HEALTH_URL" "$HEALTH_TIMEOUT" "the vLLM extractor"
fi

# 3. jax.distributed coordinator. dspark_jax starts jax.distributed when
#    JAX_COORDINATOR_ADDRESS is set (TPU_WORKER_HOSTNAMES, its other TPU signal, is set on
#    GKE but not in a TPU VM's ssh session); JAX then reads the process count and index
#    from the TPU metadata. Worker 0 hosts the coordinator on JAX's TPU port 8482.
if [[ -z "${JAX_COORDINATOR_ADDRESS:-}" ]]; then
  DESCRIBE=(gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GCLOUD_FLAGS[@]}"
    '--format=value(networkEndpoints[0].ipAddress)')
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "[local] $(shell_join "${DESCRIBE[@]}")  # -> WORKER0_IP"
    JAX_COORDINATOR_ADDRESS='WORKER0_IP:8482'
  else
    worker0=$("${DESCRIBE[@]}") || die "could not read worker 0's address of TPU $TPU_NAME (set JAX_COORDINATOR_ADDRESS=IP:8482)"
    [[ -n "$worker0" ]] || die "TPU $TPU_NAME reports no worker address (set JAX_COORDINATOR_ADDRESS=IP:8482)"
    JAX_COORDINATOR_ADDRESS="$worker0:8482"
  fi
fi

# 4. The trainer on all workers. Relative paths (DATA_PATH, SAVE_PATH, ...) are relative to
#    REMOTE_DIR; SAVE_PATH must be shared by all workers (checkpoints are written jointly).
build_trainer_cmd "$VLLM_ENDPOINT" "${MOONCAKE_MASTER:-}"
REMOTE_CMD="cd $(shell_join "$REMOTE_DIR") && $(shell_join env "JAX_COORDINATOR_ADDRESS=$JAX_COORDINATOR_ADDRESS" "${TRAIN_CMD[@]}")"
if [[ "$DRY_RUN" == 1 ]]; then
  echo "[tpu worker all] $REMOTE_CMD"
fi
run local "${SSH_ALL[@]}" "$REMOTE_CMD"
