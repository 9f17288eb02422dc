"""Issue 4, test 4: the vLLM backend against a stand-in server speaking vLLM's protocol
(OpenAI completions + kv_transfer_params, file connector with .lock files)."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from launch import extract_hidden_states as ehs
from launch.vllm_backend import SampleError, VllmClient, serve_command

from .conftest import DEMO_TARGET_LAYERS, REPO
from .fake_vllm import FakeVllm, install_vllm_shim, synthetic_hidden_states

N_ROWS = 6


@pytest.fixture(scope="module")
def rows(small_prepared):
    ds = load_from_disk(str(small_prepared)).with_format(None)
    return [ds[i]["input_ids"] for i in range(N_ROWS)]


@pytest.fixture
def fake(tmp_path, verifier_path, extractor):
    servers = []

    def make(faults=None, served="demo-verifier", write_delay=0.2):
        srv = FakeVllm(
            verifier_path,
            served,
            extractor.layer_ids,
            tmp_path / "stage",
            extractor=extractor,
            faults=faults,
            write_delay=write_delay,
        ).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


def _args(small_prepared, out, *extra):
    return ehs.parse_args(
        [
            "--backend",
            "vllm",
            "--model",
            str(REPO / "configs/demo/verifier"),
            "--preprocessed-data",
            str(small_prepared),
            "--output",
            str(out),
            "--target-layer-ids",
            *map(str, DEMO_TARGET_LAYERS),
            "--max-samples",
            str(N_ROWS),
            "--retry-backoff",
            "0.01",
            "--concurrency",
            "3",
            "--lock-timeout",
            "5",
            *extra,
        ]
    )


def test_files_moved_validated_and_equal_to_hf(
    tmp_path, small_prepared, fake, rows, extractor, verifier_path
):
    srv = fake(write_delay=0.3)  # files appear only after the answer: the lock must be waited on
    out = tmp_path / "hs"
    args = _args(
        small_prepared,
        out,
        "--endpoint",
        srv.base_url + "/v1",
        "--served-model-name",
        "demo-verifier",
    )
    args.model = verifier_path
    summary = ehs.run(args)
    assert summary.written == N_ROWS and not summary.failed
    for i, ids in enumerate(rows):
        f = load_file(out / f"hs_{i}.safetensors")
        assert f["token_ids"].tolist() == ids
        # identical to the hf backend's file content
        assert torch.equal(f["hidden_states"], extractor.extract([ids])[0])
    # staged files moved, lock files taken and removed, nothing partial left
    assert list((tmp_path / "stage").iterdir()) == []
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert json.loads((out / "extraction_config.json").read_text())["layer_ids"] == [1, 2, 3, 4]
    # the requests were what vLLM's extraction path expects
    assert len(srv.requests) == N_ROWS
    for body in srv.requests:
        assert body["model"] == "demo-verifier" and body["max_tokens"] == 1
        assert body["return_token_ids"] is True and body["prompt"] in rows


def test_server_errors_are_retried_then_reported(
    tmp_path, small_prepared, fake, rows, caplog, verifier_path
):
    first = rows[0][0]
    assert all(r[0] == first for r in rows)  # chat template: every row starts alike
    srv = fake(faults={"*": {"http_500": 2}})
    client = VllmClient(srv.base_url + "/v1", "demo-verifier", max_retries=2, retry_backoff=0.01)
    client.check_model()
    with caplog.at_level(logging.WARNING):
        client.fetch(0, rows[0], tmp_path, num_slots=4, hidden_size=None, dtype="bfloat16")
    assert (tmp_path / "hs_0.safetensors").exists()
    assert len(srv.requests) == 3 and "HTTP 500" in caplog.text

    client1 = VllmClient(srv.base_url + "/v1", "demo-verifier", max_retries=1, retry_backoff=0.01)
    with pytest.raises(SampleError) as ei:
        client1.fetch(1, rows[1], tmp_path, num_slots=4, hidden_size=None, dtype="bfloat16")
    msg = str(ei.value)
    assert "sample 1 (hs_1.safetensors)" in msg and "HTTP 500" in msg
    assert f"POST {srv.base_url}/v1/completions model='demo-verifier'" in msg
    assert f"prompt=<{len(rows[1])} tokens: [{rows[1][0]}, " in msg
    assert len(srv.requests) == 3 + 2 and not (tmp_path / "hs_1.safetensors").exists()


def test_token_mismatch_and_bad_files(tmp_path, small_prepared, fake, rows, verifier_path):
    # a wrong answer, then a file with wrong token ids: each round trip is repeated
    for i, fault in enumerate(("mismatch", "bad_file_tokens")):
        srv = fake(faults={"*": {fault: 1}})
        ok = VllmClient(
            srv.base_url + "/v1", "demo-verifier", validation_retries=1, retry_backoff=0.01
        )
        ok.fetch(i, rows[i], tmp_path, num_slots=4, hidden_size=None, dtype="bfloat16")
        assert len(srv.requests) == 2, fault
        assert load_file(tmp_path / f"hs_{i}.safetensors")["token_ids"].tolist() == rows[i]

    srv2 = fake(faults={"*": {"mismatch": 10}})
    bad = VllmClient(srv2.base_url + "/v1", "demo-verifier", validation_retries=1)
    with pytest.raises(SampleError, match=r"prompt token ids mismatch.*") as ei:
        bad.fetch(2, rows[2], tmp_path, num_slots=4, hidden_size=None, dtype="bfloat16")
    assert "after 2 round trip(s)" in str(ei.value) and "model='demo-verifier'" in str(ei.value)
    assert not (tmp_path / "hs_2.safetensors").exists()

    srv3 = fake(faults={"*": {"bad_file_tokens": 10}})
    bad3 = VllmClient(srv3.base_url + "/v1", "demo-verifier", validation_retries=0)
    with pytest.raises(SampleError, match="token_ids do not match"):
        bad3.fetch(3, rows[3], tmp_path, num_slots=4, hidden_size=None, dtype="bfloat16")
    assert not (tmp_path / "hs_3.safetensors").exists()
    # rejected files are deleted, not left in the staging folder
    assert [p for p in (tmp_path / "stage").iterdir()] == []


def test_lock_is_honoured(tmp_path, fake, rows):
    srv = fake(faults={"*": {"hold_lock": True}}, write_delay=0.0)
    client = VllmClient(
        srv.base_url + "/v1", "demo-verifier", validation_retries=0, lock_timeout=0.5
    )
    with pytest.raises(SampleError, match="waiting for the writer's lock"):
        client.fetch(0, rows[0], tmp_path, num_slots=4, hidden_size=None, dtype="bfloat16")
    assert not (tmp_path / "hs_0.safetensors").exists()


def test_run_reports_failures_and_fail_on_error(
    tmp_path, small_prepared, fake, rows, verifier_path
):
    # only the row starting with a given first token fails; every row starts alike, so
    # fail everything and check the summary and the exit status
    srv = fake(faults={"*": {"http_500": 100}})
    args = _args(
        small_prepared,
        tmp_path / "o",
        "--endpoint",
        srv.base_url + "/v1",
        "--served-model-name",
        "demo-verifier",
        "--max-retries",
        "0",
        "--max-consecutive-errors",
        "100",
    )
    args.model = verifier_path
    summary = ehs.run(args)
    assert summary.written == 0 and sorted(summary.failed) == list(range(N_ROWS))
    assert "HTTP 500" in summary.report() and "failed samples: 0, 1, 2, 3, 4, 5" in summary.report()

    args.fail_on_error = True
    with pytest.raises(SampleError):
        ehs.run(args)
    args.fail_on_error, args.max_consecutive_errors = False, 2
    with pytest.raises(RuntimeError, match="2 consecutive samples failed"):
        ehs.run(args)


def test_served_model_must_match(tmp_path, fake, rows):
    srv = fake(served="someone/else")
    with pytest.raises(ValueError, match="serves 'someone/else'"):
        VllmClient(srv.base_url + "/v1", "demo-verifier").check_model()


def test_serve_command_has_the_extract_hidden_states_form(verifier_path):
    """The speculative config vLLM's extract_hidden_states method reads (written out by
    hand: speculators' scripts/launch_vllm.py is not in its wheel, so nothing to call)."""
    cmd = serve_command(
        "m",
        [1, 2, 3, 4],
        {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": "/x"},
        },
        ["--port", "9"],
        python="py",
    )
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "m"]
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    assert spec == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}},
    }
    assert cmd[-2:] == ["--port", "9"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launches_server_waits_for_health_and_stops_it(
    tmp_path, small_prepared, monkeypatch, verifier_path, extractor, rows, capsys
):
    shim = install_vllm_shim(tmp_path / "shim")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim), str(REPO)]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = _free_port()
    out = tmp_path / "hs"
    argv = [
        "--backend",
        "vllm",
        "--model",
        verifier_path,
        "--preprocessed-data",
        str(small_prepared),
        "--output",
        str(out),
        "--target-layer-ids",
        *map(str, DEMO_TARGET_LAYERS),
        "--max-samples",
        "3",
        "--retry-backoff",
        "0.01",
        "--vllm-python",
        sys.executable,
        "--health-timeout",
        "120",
        "--dtype",
        "float32",
        "--",
        "--port",
        str(port),
        "--served-model-name",
        "demo",
        "--max-model-len",
        "4096",
    ]
    assert ehs.main(["--dry-run", *argv]) == 0
    printed = capsys.readouterr().out
    assert "vllm.entrypoints.cli.main serve" in printed and '"shared_storage_path"' in printed
    assert not out.exists() or not list(out.glob("hs_*"))
    assert ehs.main(argv) == 0
    for i in range(3):
        f = load_file(out / f"hs_{i}.safetensors")
        assert f["token_ids"].tolist() == rows[i]
        want = synthetic_hidden_states(rows[i], [1, 2, 3, 4], extractor.hidden_size)
        assert torch.equal(f["hidden_states"], torch.from_numpy(want))
    log_text = (out / "vllm_server.log").read_text()
    assert "fake vllm serving" in log_text and "layers [1, 2, 3, 4]" in log_text
    with socket.socket() as s:  # the server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_float32_config_and_unsorted_ids_through_launched_server(
    tmp_path, small_prepared, monkeypatch, verifier_path, rows, capsys
):
    """vLLM serves a float32-config verifier in bf16 on compute capability >= 8.0 and
    captures layers ascending: the launcher asks for exactly that, the client accepts
    the files, and extraction_config.json says what they hold."""
    config = json.loads((Path(verifier_path) / "config.json").read_text())
    model = tmp_path / "f32-verifier"  # only config.json is read on the vllm backend
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    shim = install_vllm_shim(tmp_path / "shim")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim), str(REPO)]))
    out, port = tmp_path / "hs", _free_port()
    argv = ["--backend", "vllm", "--model", str(model), "--preprocessed-data", str(small_prepared)]
    argv += ["--output", str(out), "--target-layer-ids", "3", "1", "2", "--max-samples", "2"]
    argv += ["--retry-backoff", "0.01", "--vllm-python", sys.executable, "--health-timeout", "120"]
    argv += ["--compute-capability", "9.0", "--", "--port", str(port)]
    assert ehs.main(["--dry-run", *argv]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
        4,
    ]
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert ehs.main(argv) == 0
    record = json.loads((out / "extraction_config.json").read_text())
    assert record["layer_ids"] == [1, 2, 3, 4] and record["dtype"] == "bfloat16"
    for i in range(2):
        hs = load_file(out / f"hs_{i}.safetensors")["hidden_states"]
        want = synthetic_hidden_states(rows[i], [1, 2, 3, 4], config["hidden_size"], "bfloat16")
        assert torch.equal(hs, torch.from_numpy(want.view(np.int16)).view(torch.bfloat16))


def test_mla_verifier_refused_before_any_server(tmp_path, small_prepared, monkeypatch, capsys):
    """vLLM's file connector refuses MLA verifiers once loaded; we refuse up front, with
    one line (the command-line guard) and nothing written."""
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "kv_lora_rank": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--backend", "vllm", "--model", str(tmp_path), "--preprocessed-data"]
    argv += [str(small_prepared), "--output", str(tmp_path / "hs"), "--dry-run"]
    assert ehs.main(argv) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"^error: .*MLA verifier.*Mooncake", last), last
    assert not (tmp_path / "hs").exists()


def test_stand_in_captures_layers_ascending(tmp_path, verifier_path, rows):
    """The stand-in does what vLLM does with ids listed out of order."""
    srv = FakeVllm(
        verifier_path, "m", [3, 1, 4, 2], tmp_path / "stage", synthetic_hidden_size=8
    ).start()
    try:
        client = VllmClient(srv.base_url + "/v1", "m", retry_backoff=0.01)
        path = client.fetch(0, rows[0], tmp_path, num_slots=4, hidden_size=8, dtype="float32")
    finally:
        srv.stop()
    want = synthetic_hidden_states(rows[0], [1, 2, 3, 4], 8)
    assert np.array_equal(load_file(path)["hidden_states"].numpy(), want)


@pytest.mark.reference  # the mooncake backend and its flags come from hs_connectors
@pytest.mark.filterwarnings("ignore:Using custom target layer ids")
def test_launch_vllm_accepts_the_seed_command(verifier_path):
    """docs/seed_run.md, "Extraction", with the demo verifier in place of Kimi-K3."""
    from launch.launch_vllm import build

    pytest.importorskip("hs_connectors")
    cmd, dry = build(
        [
            verifier_path,
            "--hidden-states-backend",
            "mooncake",
            "--mooncake-master",
            "h:50051",
            "--mooncake-metadata-server",
            "P2PHANDSHAKE",
            "--mooncake-protocol",
            "tcp",
            "--mooncake-global-segment-gib",
            "32",
            "--mooncake-local-buffer-gib",
            "4",
            "--mooncake-writer-threads",
            "4",
            "--target-layer-ids",
            "1",
            "2",
            "3",
            "--trust-remote-code",
            "--dry-run",
            "--",
            "--served-model-name",
            "demo",
            "--tensor-parallel-size",
            "8",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--port",
            "8000",
            "--max-model-len",
            "8193",
            "--no-enable-prefix-caching",
            "--language-model-only",
        ]
    )
    assert dry and cmd[3:5] == ["serve", verifier_path]
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
        4,
    ]
    kv = json.loads(cmd[cmd.index("--kv_transfer_config") + 1])
    assert kv["kv_connector"] == "MooncakeHiddenStatesConnector"
    moon = kv["kv_connector_extra_config"]["mooncake"]
    assert moon["master_server_address"] == "h:50051" and moon["num_writer_threads"] == 4
    assert moon["global_segment_size"] == 32 * 1024**3
    tail = cmd[cmd.index("--kv_transfer_config") + 2 :]
    assert tail[:2] == ["--served-model-name", "demo"] and tail[-3] == "--language-model-only"
    assert tail[-2:] == ["--dtype", "bfloat16"]  # what vLLM's auto picks for a bf16 config
    assert "--" not in tail and len(tail) == 16
    file_cmd, _ = build([verifier_path, "--hidden-states-path", "/x", "--target-layer-ids", "2"])
    assert json.loads(file_cmd[file_cmd.index("--kv_transfer_config") + 1]) == {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/x"},
    }
