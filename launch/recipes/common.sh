# shellcheck shell=bash
# Sourced by slurm_dspark.sbatch and tpu_pod.sh, never run: messages, the dry-run
# printer, the HTTP readiness wait, the MLA check of file transport, and the trainer
# command of docs/seed_run.md §4. The sourcing script sets RECIPE (its name, prefixed to
# messages), REPO_DIR (the repository root) and `set -euo pipefail`.

RECIPE=${RECIPE:-recipe}

die() {
  printf '%s: error: %s\n' "$RECIPE" "$*" >&2
  exit 1
}

log() {
  printf '%s: %s\n' "$RECIPE" "$*" >&2
}

# require NAME...: each variable must be set and non-empty (a one-line error otherwise).
require() {
  local name
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || die "$name is not set (see launch/recipes/README.md)"
  done
}

# require_uint NAME...: each variable must be a non-negative integer.
require_uint() {
  local name
  for name in "$@"; do
    [[ "${!name}" =~ ^[0-9]+$ ]] || die "$name must be a non-negative integer, got '${!name}'"
  done
}

# require_flag NAME...: each variable must be 0 or 1.
require_flag() {
  local name
  for name in "$@"; do
    [[ "${!name}" == 0 || "${!name}" == 1 ]] || die "$name must be 0 or 1, got '${!name}'"
  done
}

# shell_join WORD...: one line that a POSIX shell splits back into exactly these words.
# Used for the dry run, the logs and the remote command of `gcloud ... ssh --command`,
# so what is printed is what runs. Plain words stay bare for readability.
_SAFE_WORD='^[A-Za-z0-9_./:=,@%+-]+$'
shell_join() {
  local out=() w
  for w in "$@"; do
    if [[ "$w" =~ $_SAFE_WORD ]]; then
      out+=("$w")
    else
      out+=("${w@Q}")
    fi
  done
  local IFS=' '
  printf '%s\n' "${out[*]}"
}

# wait_http URL TIMEOUT_S WHAT [PID...]: poll URL until it answers HTTP 200. Dies after
# TIMEOUT_S seconds, or as soon as one of the PIDs (the background steps serving URL)
# has exited, so a crashed server is reported at once instead of at the timeout.
wait_http() {
  local url=$1 timeout=$2 what=$3 code=000 pid rc
  shift 3
  local deadline=$((SECONDS + timeout))
  log "waiting up to ${timeout}s for $what: GET $url -> 200"
  while true; do
    code=$(curl --silent --output /dev/null --write-out '%{http_code}' --max-time 10 "$url") || true
    if [[ "$code" == 200 ]]; then
      log "$what is up ($url)"
      return 0
    fi
    for pid in "$@"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        rc=0
        wait "$pid" || rc=$?
        die "$what exited (status $rc) before $url answered 200"
      fi
    done
    if ((SECONDS >= deadline)); then
      die "$what did not answer 200 at $url within ${timeout}s (last HTTP status $code)"
    fi
    sleep "$HEALTH_INTERVAL"
  done
}

# Settings shared by both recipes (README.md lists them). Defaults are the seed run's.
: "${TRANSPORT:=mooncake}"
: "${HEALTH_TIMEOUT:=3600}"  # loading a Kimi-K3-sized verifier takes tens of minutes
: "${HEALTH_INTERVAL:=10}"
: "${TRAIN_PYTHON:=python}"
: "${TRUST_REMOTE_CODE:=0}"
: "${TOTAL_SEQ_LEN:=8192}"
: "${EPOCHS:=1}"
: "${LR:=1e-4}"
: "${MOONCAKE_METADATA_SERVER:=P2PHANDSHAKE}"
: "${MOONCAKE_PROTOCOL:=tcp}"
: "${MOONCAKE_DEVICE:=}"
: "${MOONCAKE_WRITER_THREADS:=4}"
# The trainer only reads from the store, so it registers no global segment.
: "${TRAIN_SEGMENT_GIB:=0}"
: "${TRAIN_BUFFER_GIB:=4}"

# refuse_mla_file_transport: TRANSPORT=file goes through vLLM's file connector, which
# refuses MLA verifiers (Kimi-K3, DeepSeek-V3), but only after loading them for minutes.
# Decided here from the verifier's config.json when it is readable on this machine
# (launch/mla.py, standard library only); relative paths are relative to REPO_DIR.
refuse_mla_file_transport() {
  [[ "$TRANSPORT" == file ]] || return 0
  local dir path msg
  for dir in "$MODEL" "$VERIFIER_PATH"; do
    path=$dir
    [[ "$path" == /* ]] || path="$REPO_DIR/$path"
    [[ -f "$path/config.json" ]] || continue
    if ! command -v python3 >/dev/null; then
      log "warning: no python3 here: TRANSPORT=file not checked against MLA verifiers"
      return 0
    fi
    if ! msg=$(cd -- "$REPO_DIR" && python3 -m launch.mla "$path" 2>&1); then
      die "TRANSPORT=file: $msg"
    fi
    return 0
  done
  log "warning: no config.json at MODEL=$MODEL or VERIFIER_PATH=$VERIFIER_PATH on this machine: TRANSPORT=file not checked against MLA verifiers (use TRANSPORT=mooncake for them)"
}

# check_common: validate the shared settings and derive VERIFIER_PATH, SAVE_PATH,
# HS_PATH and the TARGET_LAYERS / TRAIN_EXTRA arrays. MODEL and DATA_PATH are required.
check_common() {
  require MODEL DATA_PATH
  require_flag TRUST_REMOTE_CODE
  require_uint HEALTH_TIMEOUT HEALTH_INTERVAL TOTAL_SEQ_LEN EPOCHS
  case "$TRANSPORT" in
    mooncake | file) ;;
    *) die "TRANSPORT must be mooncake or file, got '$TRANSPORT'" ;;
  esac
  # The trainer reads the verifier from a local folder; the default assumes MODEL is one
  # (a path on the shared filesystem) and that vLLM serves it under that name.
  : "${VERIFIER_PATH:=$MODEL}"
  # The seed's layout: <run>/data (prepare_data output) next to <run>/checkpoints.
  if [[ -z "${SAVE_PATH:-}" ]]; then
    SAVE_PATH="$(dirname -- "$DATA_PATH")/checkpoints"
  fi
  # File transport: the trainer's own default folder, named explicitly so that the
  # extractor writes where the trainer reads.
  : "${HS_PATH:=$DATA_PATH/hidden_states}"
  # Word lists (split on whitespace, no quoting): layer ids and extra trainer flags.
  read -r -a TARGET_LAYERS <<<"${TARGET_LAYER_IDS:-}"
  read -r -a TRAIN_EXTRA <<<"${TRAIN_ARGS:-}"
  local id
  for id in "${TARGET_LAYERS[@]}"; do
    [[ "$id" =~ ^[0-9]+$ ]] || die "TARGET_LAYER_IDS must be space-separated integers, got '$TARGET_LAYER_IDS'"
  done
  # vLLM captures the layers in ascending order whatever order it is given, so the
  # trainer is given that order too.
  if ((${#TARGET_LAYERS[@]})); then
    mapfile -t TARGET_LAYERS < <(printf '%s\n' "${TARGET_LAYERS[@]}" | sort -n)
  fi
  refuse_mla_file_transport
}

# build_trainer_cmd ENDPOINT MOONCAKE_ADDR: set TRAIN_CMD to `python -m dspark_jax.train`
# with every flag of docs/seed_run.md §4. ENDPOINT is the extractor's http://HOST:PORT/v1;
# MOONCAKE_ADDR (HOST:PORT) is used with TRANSPORT=mooncake. TRAIN_ARGS come last, so
# they override any flag here (argparse keeps the last value).
build_trainer_cmd() {
  local endpoint=$1 mooncake_addr=$2
  TRAIN_CMD=("$TRAIN_PYTHON" -m dspark_jax.train --verifier-name-or-path "$VERIFIER_PATH")
  if [[ "$TRUST_REMOTE_CODE" == 1 ]]; then
    TRAIN_CMD+=(--trust-remote-code)
  fi
  if [[ -n "${DRAFT_CONFIG:-}" ]]; then
    TRAIN_CMD+=(--draft-config "$DRAFT_CONFIG")
  fi
  TRAIN_CMD+=(--data-path "$DATA_PATH" --save-path "$SAVE_PATH")
  # Unset: the trainer derives them from the prepared data and the verifier tokenizer.
  if [[ -n "${DRAFT_VOCAB_SIZE:-}" ]]; then
    TRAIN_CMD+=(--draft-vocab-size "$DRAFT_VOCAB_SIZE")
  fi
  if [[ -n "${MASK_TOKEN_ID:-}" ]]; then
    TRAIN_CMD+=(--mask-token-id "$MASK_TOKEN_ID")
  fi
  TRAIN_CMD+=(--epochs "$EPOCHS" --checkpoint-freq 0.1 --total-seq-len "$TOTAL_SEQ_LEN"
    --train-data-ratio 0.999 --speculator-type dspark)
  # Must equal the extractor's ids; unset, both sides use the same default [2, n//2, n-3].
  if ((${#TARGET_LAYERS[@]})); then
    TRAIN_CMD+=(--target-layer-ids "${TARGET_LAYERS[@]}")
  fi
  TRAIN_CMD+=(--block-size 8 --max-anchors 1024 --dflash-decay-gamma 4.0
    --markov-rank 256 --markov-head-type vanilla
    --enable-confidence-head --confidence-head-with-markov --confidence-head-alpha 1.0
    --loss-fn '{"ce":0.1,"tv":0.9}' --optimizer muon --lr "$LR"
    --scheduler-type cosine --scheduler-warmup-ratio 0.03)
  if [[ "$TRANSPORT" == mooncake ]]; then
    TRAIN_CMD+=(--hidden-states-backend mooncake --mooncake-master "$mooncake_addr"
      --mooncake-metadata-server "$MOONCAKE_METADATA_SERVER"
      --mooncake-protocol "$MOONCAKE_PROTOCOL")
    if [[ -n "$MOONCAKE_DEVICE" ]]; then
      TRAIN_CMD+=(--mooncake-device "$MOONCAKE_DEVICE")
    fi
    TRAIN_CMD+=(--mooncake-global-segment-gib "$TRAIN_SEGMENT_GIB"
      --mooncake-local-buffer-gib "$TRAIN_BUFFER_GIB"
      --mooncake-writer-threads "$MOONCAKE_WRITER_THREADS")
  else
    TRAIN_CMD+=(--hidden-states-backend file --hidden-states-path "$HS_PATH")
  fi
  # --on-generate delete is deprecated (no effect); kept because the seed passes it.
  TRAIN_CMD+=(--vllm-endpoint "$endpoint" --on-missing generate --on-generate delete
    --request-timeout 900 --max-retries 5 --generation-validation-retries 2
    --max-consecutive-generation-failures 20 --num-workers 2 --prefetch-factor 2
    --log-freq 20 "${TRAIN_EXTRA[@]}")
}
