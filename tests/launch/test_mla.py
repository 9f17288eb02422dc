"""launch/mla.py: vLLM 0.33.0's MLA rule (``ModelConfig.use_mla``) and the one-line
refusal of file transport that the launchers and recipes print."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launch.mla import file_transport_refusal, uses_mla

from .conftest import REPO, VERIFIER

DEEPSEEK_V3 = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536}
# Kimi-K3's shape: a multimodal wrapper around a DeepSeek-V3-style text model
KIMI = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_k2", "kv_lora_rank": 512}}


@pytest.mark.parametrize(
    ("config", "mla"),
    [
        (DEEPSEEK_V3, True),
        (KIMI, True),
        ({"model_type": "deepseek_v2", "kv_lora_rank": 512, "q_lora_rank": None}, True),  # Lite
        ({"model_type": "deepseek_v3", "kv_lora_rank": None}, False),
        ({**DEEPSEEK_V3, "is_causal": False}, False),  # bidirectional: vLLM's non-MLA path
        ({"model_type": "minicpm3", "kv_lora_rank": 256}, False),  # not on vLLM's MLA list
        ({"model_type": "qwen3"}, False),
    ],
)
def test_uses_mla_is_vllms_rule(config, mla, monkeypatch):
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    assert uses_mla(config) is mla


def test_vllm_mla_disable(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    assert not uses_mla(DEEPSEEK_V3)


def test_cli_one_line_refusal_naming_mooncake(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(KIMI))
    msg = file_transport_refusal(KIMI, "/m/Kimi-K3")
    assert "MLA" in msg and "Mooncake" in msg and "\n" not in msg
    # standard library only: the recipes run it with any python3
    run = [sys.executable, "-S", "-m", "launch.mla"]  # -S: no site-packages
    proc = subprocess.run([*run, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout.strip().splitlines() == [
        file_transport_refusal(KIMI, str(tmp_path))
    ]
    proc = subprocess.run([*run, str(VERIFIER)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == ""
