"""The demo's export step, as the Makefile runs it, on a random drafter of the demo's
geometry (configs/demo/train.yaml on configs/demo/verifier): it passes
``check --verifier configs/demo/verifier``, is served in both forms, keeps its
confidence head in fp32 with the temperature folded in, and carries its model card.
(``make demo`` itself trains for ~20 minutes; this runs its export recipe verbatim.)"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from converters.__main__ import main
from dspark_jax.checkpoint import orbax_io
from dspark_jax.convert.check import check_folder
from dspark_jax.eval import calibration
from dspark_jax.train import drafter_setup
from dspark_jax.train import flags as cli
from tests.converters.helpers import base_config, make_vocab, random_params

ROOT = Path(__file__).resolve().parents[2]
STEP = 7


def makefile_recipe(target: str, subst: dict[str, str]) -> list[list[str]]:
    """The commands of the Makefile rule for ``target``, variables substituted."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    variables = dict(re.findall(r"^(\w+) *[?:]?= *(.*)$", text, re.M)) | subst
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(target + ":"))
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        cmd = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], line.strip())
        commands.append(shlex.split(cmd))
    return commands


def acceptance(n: int, values: list[float]) -> dict:
    return {"cumulative": values[:n], "acceptance_length": 1 + sum(values[:n])}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """runs/demo as the Makefile leaves it before step 4: checkpoint, run.yaml, eval."""
    run = tmp_path_factory.mktemp("demo")
    maps = make_vocab(base_config(vocab_size=4096, draft_vocab_size=2048, mask_token_id=3))
    for name, array in zip(("d2t", "t2d"), maps, strict=True):
        np.save(run / f"{name}.npy", array)
    argv = ["--config", str(ROOT / "configs/demo/train.yaml")]
    argv += ["--verifier-name-or-path", str(ROOT / "configs/demo/verifier")]
    argv += ["--data-path", str(run / "data"), "--save-path", str(run / "checkpoints")]
    argv += ["--d2t-path", str(run / "d2t.npy"), "--t2d-path", str(run / "t2d.npy")]
    args = cli.resolve(argv)
    cfg = drafter_setup.build_draft(args).cfg
    ckpt = run / "checkpoints"
    meta = {"metrics": {"loss": 1.0}}
    orbax_io.save_params_checkpoint(ckpt, STEP, cfg, random_params(cfg, seed=2), meta=meta)
    orbax_io.save_checkpoint_vocab_maps(ckpt, cfg, *maps)
    args.save(ckpt)
    # The eval outputs step 4 reads (their numbers made up; their format the eval's).
    n = cfg.speculative_tokens
    (run / "eval").mkdir()
    summary = {
        "format": "dspark-jax/eval-v1",
        "step": STEP,
        "block_size": cfg.block_size,
        "draft_positions": n,
        "datasets": {
            "heldout": {
                "acceptance": {
                    "analytic/free_running": acceptance(n, [0.6, 0.4, 0.25, 0.15, 0.1] + [0.05] * 3),
                    "greedy/free_running": acceptance(n, [0.5, 0.3, 0.2, 0.1, 0.05] + [0.02] * 3),
                }
            }
        },
    }  # fmt: skip
    (run / "eval" / "summary.json").write_text(json.dumps(summary))
    record = calibration.calibration_record(
        1.7, "sampled", block_size=cfg.block_size, sample_from_anchor=True, step=STEP,
        ece={"uncalibrated": 0.12, "calibrated": 0.03},
    )  # fmt: skip
    calibration.save_temperatures(run / "eval" / "calibration.json", record)
    return run, cfg


def test_makefile_export_step_serves_in_both_forms(demo_run, capsys):
    run, cfg = demo_run
    verifier = ROOT / "configs/demo/verifier"
    recipe = makefile_recipe(
        "$(DEMO)/export/README.md", {"DEMO": str(run), "VERIFIER": str(verifier), "PY": "python"}
    )
    assert [c[:4] for c in recipe] == [["python", "-m", "converters", "export"],
                                       ["python", "-m", "converters", "check"]]  # fmt: skip
    capsys.readouterr()
    for command in recipe:
        assert main(command[3:]) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    export = run / "export"
    commands = [
        f"vllm serve {export}",
        f"vllm serve {verifier} --spec-method dspark --spec-model {export} --spec-tokens 8",
    ]
    assert printed.rstrip().endswith("\n".join(f"  {c}" for c in commands)), printed

    report = check_folder(export, verifier=verifier)
    assert report.ok and report.warnings == [] and report.commands == commands
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "dspark-jax/demo-verifier"
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    with safe_open(export / "model.safetensors", "np") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["confidence_head.proj.weight"] == dtypes["confidence_head.proj.bias"] == "F32"
    assert json.loads((export / "calibration.json").read_text())["temperature"] == 1.7

    card = (export / "README.md").read_text()
    # The card is published: the verifier by its Hub name, the folder relative, the run's
    # paths relative to it; nothing in the folder names the training machine's paths.
    card_commands = [
        f"vllm serve {export.name}",
        f"vllm serve dspark-jax/demo-verifier --spec-method dspark --spec-model {export.name} "
        "--spec-tokens 8",
    ]
    for path in export.iterdir():
        if path.suffix in (".md", ".json"):
            text = path.read_text()
            for local in (str(ROOT), str(run), str(Path.home())):
                assert local not in text, (path.name, local)
    assert "--verifier-name-or-path dspark-jax/demo-verifier" in card
    assert "--data-path ../data" in card and "--save-path . " in card
    for line in (
        "base_model: dspark-jax/demo-verifier",
        "# demo-verifier-speculator.dspark",
        "| Draft layers | 1 Qwen3 decoder layer: hidden 192, 4 heads / 2 KV heads x 64, MLP 512",
        "## Training command",
        "  --target-layer-ids 1 2 3 \\",
        "  --draft-vocab-size 2048 \\",
        "| Target layer ids | 1, 2, 3 |",
        "| Draft vocabulary | 2048 of the verifier's 4096 tokens (`lm_head` + `d2t`) |",
        "| Sequence length | 1024 |",
        "| Block size | 8 (sample_from_anchor=true: 8 draft tokens per step) |",
        "| Markov head | vanilla, rank 256 |",
        "calibrated (temperature 1.7000 folded in)",
        *card_commands,
        "| data | pos0 | pos1 | pos2 | pos3 | pos4 | pos5 | pos6 | pos7 | acceptance length |",
        "| heldout | 60.0% | 40.0% | 25.0% | 15.0% | 10.0% | 5.0% | 5.0% | 5.0% | 2.65 |",
        "ECE 0.1200 uncalibrated, 0.0300 with the folded temperature.",
    ):
        assert line in card, line
    # The card's training command parses back to the run's flags.
    block = card.split("```bash\n")[1].split("\n```")[0].replace(" \\\n", " ")
    # The card's training command parses back to the run's flags, paths relative to the run.
    expected = cli.resolve(["--config", str(run / "checkpoints" / "run.yaml")]).values
    ckpt = run / "checkpoints"
    expected |= {k: os.path.relpath(expected[k], ckpt) for k in ("data_path", "save_path",
                                                              "d2t_path", "t2d_path")}  # fmt: skip
    expected["verifier_name_or_path"] = "dspark-jax/demo-verifier"
    assert cli.resolve(shlex.split(block)[3:]).values == expected


def test_calibration_and_eval_of_another_step_are_refused(demo_run, tmp_path, capsys):
    run, _ = demo_run
    argv = ["export", str(run / "checkpoints"), str(tmp_path / "out"), "--step", "best"]
    argv += ["--verifier-path", str(ROOT / "configs/demo/verifier")]
    record = json.loads((run / "eval" / "calibration.json").read_text())
    bad = tmp_path / "calibration.json"
    for change, message in (
        ({"step": STEP + 1}, f"fitted on step {STEP + 1}, exporting step {STEP}"),
        ({"block_size": 4}, "fitted for block_size=4, the drafter has 8"),
        ({"format": "x"}, "format 'x', expected 'dspark-jax/calibration-v1'"),
    ):
        bad.write_text(json.dumps(record | change))
        assert main([*argv, "--calibration", str(bad)]) == 1
        assert message in capsys.readouterr().err
    summary = json.loads((run / "eval" / "summary.json").read_text())
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "summary.json").write_text(json.dumps(summary | {"step": 3}))
    assert main([*argv, "--eval-dir", str(tmp_path / "eval")]) == 1
    assert f"evaluated block_size 8 at step 3, exporting block_size 8 at step {STEP}" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def serve_commands_in(text: str) -> list[str]:
    """`vllm serve` commands of a Markdown text: lines of fenced blocks, inline code spans."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    lines = [x for b in blocks for x in b.replace("\\\n", " ").splitlines()]
    spans = [" ".join(x.split()) for x in re.findall(r"`([^`]+)`", prose)]
    return [x for x in lines + spans if "vllm serve" in x]


def test_docs_show_only_serve_forms_that_work():
    """[serve-form: vllm/engine/arg_utils.py]: `vllm serve <folder> --spec-method ...` is an
    error; a --spec-method command serves the verifier and names the drafter (--spec-model)
    and its --spec-tokens."""
    docs = [ROOT / "README.md", ROOT / "configs/demo/README.md", *(ROOT / "docs").glob("*.md")]
    commands = [(d.name, c) for d in docs for c in serve_commands_in(d.read_text())]
    spec = [x for x in commands if "--spec-method" in x[1]]
    assert len(spec) >= 4, commands
    bad = [x for x in spec if "--spec-model" not in x[1] or "--spec-tokens" not in x[1]]
    assert not bad, bad
