"""Our copies of vLLM 0.33.0's rules against vLLM's own functions (differential tests):
many seeded generated cases per rule, answered by vLLM in its own environment
(``DSPARK_VLLM_PYTHON``; one subprocess for the whole module, tests/launch/
vllm_rules_probe.py) and by our code here, which must agree on every case.

* ``--dtype`` (launch/vllm_dtype.py ``serving_dtype``) vs ``_get_and_verify_dtype`` on a
  CudaPlatform of each compute capability: config dtypes at the top level, in a text
  config, or only in the safetensors headers; every requested value; fp16-refusing types.
* The MLA check (launch/mla.py ``uses_mla``) vs ``ModelConfig.use_mla`` over
  ``is_deepseek_mla``: vLLM's MLA model types and others, with and without
  ``kv_lora_rank``, wrapped in a text config, bidirectional, DeepSeek-V4 compressed
  configs, ``VLLM_MLA_DISABLE``.
* The layer ids (launch/hs_files.py ``resolve_layer_ids``, what launch_vllm serves and
  the trainer reads slot by slot) vs ``EagleModelMixin._set_aux_hidden_state_layers``:
  our slot order is the order vLLM captures the served ids in.
* The DSpark config (dspark_jax/convert/vllm_rules.py ``check``'s ``Served``, and the
  trained :class:`DSparkConfig`) vs the config vLLM builds from the exported config.json
  (``get_config``: ``SpeculatorsConfig``/``update_dspark``, ``patch_rope_parameters``),
  ``maybe_override_with_speculators`` (``vllm serve <folder>``) and
  ``qwen3_dflash._resolve_layer_attention``: geometry, vocabularies, aux and target layer
  ids, mask token, heads, block size, vLLM's defaults for fields left out, every layer's
  sliding window and causality, RoPE parameters; check's refusals (a non-causal sliding
  window, a verifier name the folder form rejects) are where vLLM differs.

Rules that live only inside GPU-bound classes keep their copies (tests/launch/
test_vllm_dtype.py, test_mla.py, test_launch_vllm.py cite vLLM's files).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoConfig

from dspark_jax.config import DSparkConfig, RopeScaling
from dspark_jax.convert import vllm_rules
from launch.hs_files import resolve_layer_ids
from launch.mla import MLA_MODEL_TYPES, uses_mla
from launch.vllm_dtype import serving_dtype

pytestmark = pytest.mark.vllm
VLLM_PYTHON = os.environ.get("DSPARK_VLLM_PYTHON")
CAPABILITIES = [(3, 7), (6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]
REQUESTED = ["auto", "auto", "auto", "half", "float16", "float", "float32", "bfloat16", "BFloat16"]
FLOATS = ["float32", "float16", "bfloat16"]
ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# model types transformers 5.19 builds a config for, fp16-refusing ones among them
TEXT_TYPES = ["qwen3", "llama", "mistral", "gemma2", "glm4", "qwen2"]


def _safetensors(path: Path, dtypes: list[str]) -> None:
    header = {
        f"w{i}": {"dtype": d, "shape": [1], "data_offsets": [0, 0]} for i, d in enumerate(dtypes)
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def _dtype_cases(root: Path, rng: np.random.Generator, n: int = 120) -> list[dict]:
    """config.json folders: dtype at the top, in a text config (gemma3), or absent with
    safetensors weights of one or several float dtypes (plus ints), or nothing at all."""
    cases = []
    for i in range(n):
        folder = root / f"dtype-{i}"
        folder.mkdir()
        where = rng.choice(["top", "top", "text", "weights", "none"])
        own = str(rng.choice(FLOATS))
        if where == "text":
            cfg = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}
            cfg["text_config"]["dtype"] = own
        else:
            cfg = {"model_type": str(rng.choice(TEXT_TYPES))}
            if where == "top":
                cfg["dtype"] = own
        if where == "weights":
            # one dtype, or float32 with another (vLLM takes the widest: float32)
            dtypes = [own] if rng.random() < 0.6 else ["float32", str(rng.choice(FLOATS[1:]))]
            _safetensors(folder / "model.safetensors", [ST[d] for d in dtypes] + ["I64"])
        (folder / "config.json").write_text(json.dumps(cfg))
        cases.append(
            {
                "folder": str(folder),
                "requested": str(rng.choice(REQUESTED)),
                "capability": [int(x) for x in CAPABILITIES[rng.integers(len(CAPABILITIES))]],
            }
        )
    return cases


def _mla_cases(rng: np.random.Generator, n: int = 200) -> list[dict]:
    mla_types = sorted(MLA_MODEL_TYPES)
    others = ["qwen3", "llama", "minicpm3", "mistral", "deepseek", "kimi_k3", "eagle3"]
    cases = []
    for _ in range(n):
        text = {"model_type": str(rng.choice(mla_types if rng.random() < 0.7 else others))}
        if rng.random() < 0.7:
            text["kv_lora_rank"] = int(rng.choice([128, 256, 512]))
        if rng.random() < 0.2:
            text["is_causal"] = bool(rng.random() < 0.5)
        if rng.random() < 0.25:  # DeepSeek-V4-style compressed attention
            if rng.random() < 0.5:
                text["compress_ratios"] = [int(x) for x in rng.integers(0, 4, 3)]
            else:
                text["compress_rates"] = {"sliding_attention": 0, "compressed": 4}
                text["layer_types"] = ["sliding_attention", "compressed"]
                text["num_nextn_predict_layers"] = int(rng.integers(0, 2))
            if rng.random() < 0.6:
                text["head_dim"] = 64
        text["num_attention_heads"] = 8
        config = text if rng.random() < 0.6 else {"model_type": "kimi_k3", "text_config": text}
        cases.append({"config": config, "disable": "1" if rng.random() < 0.05 else "0"})
    return cases


def _layer_cases(rng: np.random.Generator, n: int = 200) -> list[tuple]:
    """(target ids or None, verifier layers N, include_last_layer)."""
    cases = []
    for _ in range(n):
        layers = int(rng.integers(8, 96))
        if rng.random() < 0.2:
            ids = None
        else:
            k = int(rng.integers(1, 6))
            ids = [int(x) for x in rng.choice(layers + 1, k, replace=False)]  # any order
        cases.append((ids, layers, bool(rng.random() < 0.5)))
    return cases


def _rope(rng: np.random.Generator, head_dim: int, max_pos: int) -> RopeScaling:
    kind = str(
        rng.choice(["default", "default", "linear", "dynamic", "yarn", "llama3", "longrope"])
    )
    factor = float(rng.choice([2.0, 4.0, 8.0]))
    omp = max_pos // int(factor)
    params = {
        "default": {},
        "linear": {"factor": factor},
        "dynamic": {"factor": factor},
        "yarn": {"factor": factor, "original_max_position_embeddings": omp},
        "llama3": {
            "factor": factor,
            "original_max_position_embeddings": omp,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },  # fmt: skip
        "longrope": {
            "short_factor": [1.0] * (head_dim // 2),
            "long_factor": [float(x) for x in rng.uniform(1, 4, head_dim // 2).round(2)],
            "original_max_position_embeddings": omp,
        },
    }[kind]
    return RopeScaling(kind, params)


def _draft_config(rng: np.random.Generator, i: int) -> DSparkConfig:
    """A random drafter config as the trainer accepts it (verifier geometry included)."""
    heads = int(rng.choice([2, 4, 8]))
    head_dim = int(rng.choice([8, 16, 32, 64]))
    layers = int(rng.integers(1, 6))
    kind = rng.choice(["none", "full", "mixed", "sliding"])
    types = {
        "none": None,
        "full": ("full_attention",) * layers,
        "sliding": ("sliding_attention",) * layers,
        "mixed": tuple(str(t) for t in rng.choice(["full_attention", "sliding_attention"], layers)),
    }[str(kind)]
    sliding = types is not None and "sliding_attention" in types
    vocab = int(rng.integers(64, 5000))
    max_pos = int(rng.choice([2048, 4096, 32768]))
    verifier_layers = int(rng.integers(4, 64))
    aux = sorted(
        int(x)
        for x in rng.choice(
            np.arange(1, verifier_layers + 1), int(rng.integers(1, 5)), replace=False
        )
    )
    rank = int(rng.choice([4, 8, 64, 256]))
    names = [f"org/verifier-{i}", f"org/verifier-{i}", None, "Qwen/Qwen3-8B"]
    return DSparkConfig(
        hidden_size=heads * head_dim * int(rng.choice([1, 2])),
        intermediate_size=int(rng.choice([64, 96, 512])),
        num_attention_heads=heads,
        num_key_value_heads=int(rng.choice([h for h in (1, 2, heads) if heads % h == 0])),
        head_dim=head_dim,
        num_hidden_layers=layers,
        vocab_size=vocab,
        layer_types=types,
        sliding_window=int(rng.integers(8, 4096)) if sliding or rng.random() < 0.2 else None,
        rope_theta=float(rng.choice([1e4, 5e5, 1e6])),
        rope_scaling=_rope(rng, head_dim, max_pos),
        rms_norm_eps=float(rng.choice([1e-6, 1e-5])),
        attention_bias=bool(rng.random() < 0.2),
        max_position_embeddings=max_pos,
        block_size=int(rng.integers(2, 17)),
        mask_token_id=int(rng.integers(0, vocab)),
        aux_hidden_state_layer_ids=tuple(aux),
        draft_vocab_size=int(rng.integers(32, vocab)) if rng.random() < 0.4 else None,
        target_hidden_size=int(rng.choice([64, 192, 4096])) if rng.random() < 0.4 else None,
        sample_from_anchor=bool(rng.random() < 0.5),
        markov_rank=rank,
        enable_confidence_head=bool(rng.random() < 0.7),
        confidence_head_with_markov=bool(rng.random() < 0.5),
        sliding_window_non_causal=bool(sliding and rng.random() < 0.15),
        verifier_name_or_path=names[int(rng.integers(len(names)))],
    )


def _dspark_cases(root: Path, rng: np.random.Generator, n: int = 80) -> list[tuple]:
    """(trained config, exported config.json dict, folder): export's config.json, with
    some optional fields left out (vLLM's defaults then apply)."""
    cases = []
    while len(cases) < n:
        try:
            cfg = _draft_config(rng, len(cases))
        except ValueError:  # a combination the trainer refuses
            continue
        d = cfg.to_speculators_dict()
        if rng.random() < 0.3:
            for key in (*vllm_rules.DEFAULTED, "target_hidden_size"):
                if rng.random() < 0.4:
                    d.pop(key, None)
        folder = root / f"dspark-{len(cases)}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(d))
        cases.append((cfg, d, str(folder)))
    return cases


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """vLLM's answers to every case of every rule: one subprocess."""
    if not VLLM_PYTHON:
        pytest.skip("DSPARK_VLLM_PYTHON (a vLLM 0.33.0 env) not set")
    root = tmp_path_factory.mktemp("vllm-rules")
    rng = np.random.default_rng(30)
    dtype, mla, layers = _dtype_cases(root, rng), _mla_cases(rng), _layer_cases(rng)
    served = [resolve_layer_ids(ids, n, last) for ids, n, last in layers]
    dspark = _dspark_cases(root, rng)
    cases = {"dtype": dtype, "mla": mla, "aux": served, "dspark": [c[2] for c in dspark]}
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    script = Path(__file__).with_name("vllm_rules_probe.py")
    out = subprocess.run([VLLM_PYTHON, str(script), str(root / "cases.json")], env=env,
                         capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    return {
        "dtype": (dtype, got["dtype"]),
        "mla": (mla, got["mla"]),
        "aux": (served, got["aux"]),
        "dspark": (dspark, got["dspark"]),
    }


def _ours_dtype(case: dict) -> str:
    config = AutoConfig.from_pretrained(case["folder"])
    try:
        return serving_dtype(case["requested"], config, case["folder"], tuple(case["capability"]))
    except ValueError as e:
        return f"error: {e}"


def test_dtype_resolution_is_vllms(answers):
    cases, theirs = answers["dtype"]
    disagree = []
    for case, want in zip(cases, theirs, strict=True):
        got = _ours_dtype(case)
        # both refuse (the messages are ours: one line naming the flag), or agree
        if (got.startswith("error") != want.startswith("error")) or (
            not want.startswith("error") and got != want
        ):
            disagree.append((case, got, want))
    assert not disagree, disagree[:5]
    assert {w for w in theirs} >= {"bfloat16", "float16", "float32"}  # every outcome seen
    assert any(w.startswith("error") for w in theirs)


def test_mla_check_is_vllms(answers, monkeypatch):
    cases, theirs = answers["mla"]
    disagree = []
    for case, want in zip(cases, theirs, strict=True):
        monkeypatch.setenv("VLLM_MLA_DISABLE", case["disable"])
        if uses_mla(case["config"]) is not want:
            disagree.append((case, want))
    assert not disagree, disagree[:5]
    assert 20 < sum(theirs) < len(theirs) - 20  # both outcomes, many times


def test_served_layer_ids_are_in_the_order_vllm_captures_them(answers):
    served, theirs = answers["aux"]
    for ids, captured in zip(served, theirs, strict=True):
        assert ids == captured, (ids, captured)  # slot i holds layer ids[i]


def _config_errors(f: vllm_rules.Findings) -> list[str]:
    return [e for e in f.errors if "[weights:" not in e]  # the cases have no tensors


def test_dspark_config_is_what_vllm_builds(answers):
    """check's Served (and the trainer's per-layer attention) against the draft config
    vLLM 0.33 builds from the same exported config.json, on every generated case."""
    cases, theirs = answers["dspark"]
    seen: Counter[str] = Counter()
    for (cfg, d, folder), v in zip(cases, theirs, strict=True):
        f = vllm_rules.check(d, {}, Path(folder))
        errors = _config_errors(f)
        where = f"{folder}: {errors or ''}"
        assert "error" not in v, (where, v)  # every export is a config vLLM reads
        trained = [
            [cfg.layer_sliding_window(i), cfg.layer_causal_in_block(i)]
            for i in range(cfg.num_hidden_layers)
        ]
        if (
            cfg.sliding_window_non_causal
            and cfg.layer_types
            and "sliding_attention" in cfg.layer_types
        ):
            # check refuses it because vLLM runs those layers causal: so does vLLM here
            assert any("sliding_window_non_causal" in e for e in errors), where
            assert v["layers"] != trained, where
            seen["refused: sliding_window_non_causal"] += 1
            continue
        assert not errors, where
        s = f.served
        seen.update(
            {
                "served": 1,
                "mixed layers": len({w for w, _ in trained}) > 1,
                "defaults left out": any(k not in d for k in vllm_rules.DEFAULTED),
                "rope " + cfg.rope_scaling.rope_type: 1,
                "no folder form": not f.folder_form,
            }
        )
        got = {
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim,
            "num_hidden_layers": s.num_hidden_layers,
            "vocab_size": s.vocab_size,
            "draft_vocab_size": s.draft_vocab_size,
            "target_hidden_size": s.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(s.aux_layer_ids),
            "markov_rank": s.markov_rank,
            "attention_bias": s.attention_bias,
            "enable_confidence_head": s.confidence_head,
            "confidence_head_with_markov": s.confidence_with_markov,
            "sample_from_anchor": s.sample_from_anchor,
            "block_size": s.block_size,
        }
        assert got == {k: v[k] for k in got}, where
        assert v["architectures"] == [vllm_rules.SERVED_ARCHITECTURES[0]], where
        # what the trainer trained: the layers it reads (layer k = after k layers; vLLM's
        # target_layer_ids are 0-based layer outputs), the mask token, every layer's
        # window and causality, the RoPE it rotated with
        assert v["target_layer_ids"] == [k - 1 for k in cfg.aux_hidden_state_layer_ids], where
        assert v["mask_token_id"] == cfg.mask_token_id, where
        assert v["dspark_bonus_anchor"] is (not cfg.sample_from_anchor), where
        assert v["layers"] == trained, where
        rope = v["rope_parameters"]
        assert rope["rope_type"] == cfg.rope_scaling.rope_type, where
        assert rope["rope_theta"] == cfg.rope_theta, where
        for key, value in cfg.rope_scaling.params:
            want = list(value) if isinstance(value, tuple) else value
            assert rope.get(key) == want, (where, key, rope)
        # the serve command: `vllm serve <folder>` works exactly when check says so, and
        # then drafts speculative_tokens with method dspark from the named verifier
        if f.folder_form:
            assert v["verifier"] == s.verifier_name, where
            assert v["spec"] == {"method": "dspark", "tokens": s.speculative_tokens}, where
        else:
            assert str(v["verifier"]).startswith("error: Speculators verifier"), where
    # every kind of case, several times
    assert min(seen.values()) >= 2 and len(seen) == 11, seen
