"""launch/launch_vllm.py against speculators 0.9.0's scripts/launch_vllm.py and vLLM
0.33.0: the layer ids it serves, the --dtype it passes, the MLA refusal. Only the
verifier's config.json is read, so the verifiers here are config files."""

from __future__ import annotations

import json

import pytest

from launch.launch_vllm import build, main

N = 36


def speculators_launcher_ids(n: int, target_layer_ids=None, include_last_layer=True):
    """The ids speculators 0.9.0's scripts/launch_vllm.py puts in the speculative config
    (its main(), transcribed): the default ignores --[no-]include-last-layer."""
    if not target_layer_ids:
        return [2, n // 2, n - 3, n]
    ids = list(target_layer_ids)
    if include_last_layer and n not in ids:
        ids.append(n)
    return ids


def _verifier(tmp_path, **fields):
    cfg = {"model_type": "qwen3", "num_hidden_layers": N, "hidden_size": 64, "dtype": "bfloat16"}
    cfg.update(fields)
    folder = tmp_path / f"verifier-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _served(cmd) -> tuple[list[int], list[str]]:
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    return ids, [cmd[i + 1] for i, a in enumerate(cmd) if a == "--dtype"]


@pytest.mark.filterwarnings("ignore:Using custom target layer ids")
def test_layer_ids_are_speculators_defaults_in_vllms_order(tmp_path):
    model = _verifier(tmp_path)
    for flag, last in (("--include-last-layer", True), ("--no-include-last-layer", False)):
        ids, _ = _served(build([model, flag])[0])
        assert ids == speculators_launcher_ids(N, None, last) == [2, 18, 33, 36], flag
        # typed out of order: vLLM captures ascending, so that is what is asked for
        ids, _ = _served(build([model, flag, "--target-layer-ids", "33", "2", "18"])[0])
        assert ids == sorted(speculators_launcher_ids(N, [33, 2, 18], last)), flag


def test_dtype_auto_resolved_as_vllm_and_passed(tmp_path):
    f32 = _verifier(tmp_path, dtype="float32")
    for cc, dtype in (("9.0", "bfloat16"), ("7.5", "float16")):
        _, dtypes = _served(build([f32, "--compute-capability", cc])[0])
        assert dtypes == [dtype], cc
    # an explicit vLLM --dtype is kept, once
    cmd, _ = build([f32, "--compute-capability", "9.0", "--", "--dtype=float", "--port", "1"])
    assert _served(cmd)[1] == ["float32"] and cmd[-2:] == ["--port", "1"]


def test_file_connector_refused_for_mla_verifier(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    mla = _verifier(tmp_path, model_type="deepseek_v3", kv_lora_rank=512, q_lora_rank=1536)
    with pytest.raises(ValueError, match="MLA verifier.*Mooncake"):
        build([mla, "--hidden-states-path", "/x"])
    assert main([mla, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("launch_vllm: error: ") and "mooncake" in err[0]


@pytest.mark.reference  # the Mooncake backend and its flags come from hs_connectors
def test_mooncake_connector_accepted_for_mla_verifier(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    mla = _verifier(tmp_path, model_type="deepseek_v3", kv_lora_rank=512, q_lora_rank=1536)
    cmd, _ = build([mla, "--hidden-states-backend", "mooncake"])  # the alternative is accepted
    kv = json.loads(cmd[cmd.index("--kv_transfer_config") + 1])
    assert kv["kv_connector"] == "MooncakeHiddenStatesConnector"
