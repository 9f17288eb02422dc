"""The model card (``README.md``) of an exported drafter folder.

Shaped like the seed's card (docs/seed_run.md, "Serving"): what the drafter is, the
training command, its specifications, the ``vllm serve`` commands that work for the
folder, and, from ``python -m dspark_jax.eval``'s ``summary.json``, the per-dataset,
per-position acceptance table. Host-side text only.

The training command is the run's ``run.yaml`` (the values the run was given, which
``python -m dspark_jax.train`` writes beside its checkpoints) as one flag per value,
rendered by the file's owner, :mod:`dspark_jax.run_file` (below the trainer: converting
never imports it).
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from dspark_jax.config import DSparkConfig
from dspark_jax.eval import report

CARD_FILE = "README.md"
# The card's tables: free running, as vLLM drafts (docs/math.md, "Acceptance figures to expect").
CARD_METHODS = ("analytic/free_running", "greedy/free_running")


@dataclasses.dataclass(frozen=True)
class CardInputs:
    """What the card says beyond the config; every field is optional."""

    name: str  # the folder's name (the title when no verifier is recorded)
    dtype: str = "bfloat16"
    train_command: list[str] | None = None  # from run.yaml (dspark_jax.run_file.command)
    total_seq_len: int | None = None
    step: int | None = None
    serve_commands: tuple[str, ...] = ()
    temperature: float | None = None  # folded into the confidence head
    calibration: dict[str, Any] | None = None  # the calibration.json record
    eval_summary: dict[str, Any] | None = None  # the eval's summary.json


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _command_block(argv: list[str]) -> str:
    """One flag (and its values) per line, like the seed card's commands."""
    lines, current = [], shlex.join(argv[:3])
    for arg in argv[3:]:
        if arg.startswith("--"):
            lines.append(current)
            current = "  " + arg
        else:
            current += " " + shlex.quote(arg)
    lines.append(current)
    return " \\\n".join(lines)


def _specs(cfg: DSparkConfig, c: CardInputs) -> list[str]:
    types = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
    window = f", sliding window {cfg.sliding_window}" if "sliding_attention" in types else ""
    vocab = (
        f"{cfg.draft_vocab_size} of the verifier's {cfg.vocab_size} tokens (`lm_head` + `d2t`)"
        if cfg.uses_draft_vocab
        else f"{cfg.draft_vocab_size} (the verifier's)"
    )
    if cfg.enable_confidence_head:
        conf = "linear on the draft hidden state" + (
            " and the Markov embedding" if cfg.confidence_head_with_markov else ""
        )
        conf += ", fp32"
        if c.temperature is not None:
            conf += f", calibrated (temperature {c.temperature:.4f} folded in)"
        else:
            conf += ", uncalibrated"
    else:
        conf = "none"
    rows = [
        ("Base model (verifier)", f"`{cfg.verifier_name_or_path}`"),
        (
            "Draft layers",
            f"{cfg.num_hidden_layers} Qwen3 decoder layer{'s' if cfg.num_hidden_layers > 1 else ''}"
            f": hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads x "
            f"{cfg.head_dim}, MLP {cfg.intermediate_size}, "
            f"{', '.join(sorted(set(types)))}{window}",
        ),
        ("Target layer ids", ", ".join(map(str, cfg.aux_hidden_state_layer_ids))),
        ("Draft vocabulary", vocab),
        ("Sequence length", "not recorded" if c.total_seq_len is None else str(c.total_seq_len)),
        (
            "Block size",
            f"{cfg.block_size} (sample_from_anchor={str(cfg.sample_from_anchor).lower()}: "
            f"{cfg.speculative_tokens} draft tokens per step)",
        ),
        (
            "Markov head",
            "none" if cfg.markov_rank == 0 else f"{cfg.markov_head_type}, rank {cfg.markov_rank}",
        ),
        ("Confidence head", conf),
        ("Weights", f"{c.dtype}" + (f", step {c.step}" if c.step is not None else "")),
    ]
    return ["| | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows]]


def _acceptance(summary: dict[str, Any]) -> list[str]:
    n = summary["draft_positions"]
    lines = [
        "## Acceptance",
        "",
        f"`python -m dspark_jax.eval` on held-out data, {n} draft tokens: the share of drafts "
        "accepted through each draft position and the acceptance length (bonus token "
        f"counted); the Markov head runs on the drafter's own tokens, as vLLM drafts.",
    ]
    for key in CARD_METHODS:
        rule = key.split("/")[0]
        lines += ["", f"{report.RULE_TITLES[rule]}:", "", *report.acceptance_table(summary, key)]
    return lines


def title(cfg: DSparkConfig, folder_name: str) -> str:
    """The seed's naming: ``<verifier>-speculator.dspark`` (else the folder's name)."""
    name = cfg.verifier_name_or_path
    return f"{name.rstrip('/').split('/')[-1]}-speculator.dspark" if name else folder_name


def model_card(cfg: DSparkConfig, c: CardInputs) -> str:
    """README.md of the exported folder."""
    verifier = cfg.verifier_name_or_path
    lines = [
        "---",
        f"base_model: {verifier}" if verifier else "base_model: null",
        "library_name: vllm",
        "tags:",
        "- speculative-decoding",
        "- dspark",
        "- speculators",
        "---",
        "",
        f"# {title(cfg, c.name)}",
        "",
        f"A DSpark speculative-decoding drafter for `{verifier}`: a DFlash block-parallel "
        f"backbone that drafts {cfg.speculative_tokens} tokens in one pass from the verifier's "
        "hidden states, a Markov logit bias that makes each draft token depend on the one "
        "before it, and a confidence head that predicts acceptance. Trained with dspark-jax "
        "(JAX/Flax); speculators 0.9.0 format, served by vLLM 0.33.",
        "",
        "## Training command",
        "",
    ]
    if c.train_command:
        lines += ["```bash", _command_block(c.train_command), "```"]
    else:
        lines.append("Not recorded (the checkpoint has no run.yaml).")
    lines += ["", "## Model specifications", "", *_specs(cfg, c), "", "## Deployment", ""]
    if c.serve_commands:
        lines += ["```bash", *c.serve_commands, "```"]
    else:
        lines.append(
            "Exported for speculators only (`--target speculators`): vLLM 0.33 does not serve it."
        )
    if cfg.enable_confidence_head:
        lines += [
            "",
            "The confidence head is used by vLLM's adaptive verification: add "
            "`--speculative-config '{\"enable_adaptive_verification\": true}'`.",
        ]
    if c.eval_summary is not None:
        lines += ["", *_acceptance(c.eval_summary)]
    if c.calibration is not None:
        ece = c.calibration.get("ece") or {}
        lines += [
            "",
            f"Confidence calibration ({c.calibration.get('rule')} acceptance, held-out split): "
            f"ECE {_num(ece.get('uncalibrated'))} uncalibrated, "
            f"{_num(ece.get('calibrated'))} with the folded temperature.",
        ]
    return "\n".join(lines) + "\n"
