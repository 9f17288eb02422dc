"""bench/smollm2_table.py reads the real-model run's folder: each trainer's own last
validation record, the served-equivalent figure per dataset, served vs predicted and the
decode speed-up; a run folder with nothing to report is refused in one line."""

from __future__ import annotations

import json

import pytest

from bench.smollm2_table import drafters, last_val, main, markdown, served


def _summary(path, **acceptance):
    path.mkdir(parents=True)
    datasets = {k: {"served": {"acceptance_length": v}} for k, v in acceptance.items()}
    (path / "summary.json").write_text(json.dumps({"datasets": datasets}))


def _run(tmp_path):
    out = tmp_path / "run"
    _summary(out / "judge" / "instep", humaneval=2.5, heldout=2.25)
    _summary(out / "judge" / "files-42", humaneval=2.4, heldout=2.2)
    _summary(out / "judge" / "ref-42", humaneval=2.3, heldout=2.1)
    logs = out / "instep" / "logs" / "smollm2-instep"
    logs.mkdir(parents=True)
    (logs / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"val": {"accept_len_epoch": 1.5}, "epoch": 0},
                {"train": {"accept_len": 9.0}, "epoch": 1},
                {"val": {"accept_len_epoch": 1.75}, "epoch": 1},
            ]
        )  # fmt: skip
    )
    (out / "ref-42").mkdir()
    (out / "ref-42" / "metrics.jsonl").write_text(json.dumps({"val": {"accept_len": 1.625}}))
    rec = {
        "prompts": 164,
        "served": {"acceptance_length": 2.5},
        "predicted": {"acceptance_length": 2.4975},
        "prompts_by_why": {"exact": 163, "drafter_near_tie": 1},
        "decode_speed": {
            "median_tokens_per_s": {"with": 50.0, "without": 100.0},
            "speedup": 0.5,
            "prompts": 16,
        },  # fmt: skip
    }
    (out / "served-Q4_1-humaneval.json").write_text(json.dumps(rec))
    return out


def test_table_reads_each_trainer_and_the_served_runs(tmp_path):
    out = _run(tmp_path)
    rows = drafters(out)
    assert [r["drafter"] for r in rows] == ["instep", "files-42", "ref-42"]
    assert [r["trainer"] for r in rows] == ["dspark-jax", "dspark-jax", "speculators 0.9.0"]
    assert rows[0]["val_accept_len"] == 1.75  # the last validation record, not a train one
    assert rows[1]["val_accept_len"] is None  # no metrics file: reported as missing
    assert rows[2]["val_accept_len"] == 1.625
    assert rows[2]["served_equivalent"] == {"humaneval": 2.3, "heldout": 2.1}
    srv = served(out)
    assert srv[0]["verifier_gguf"] == "Q4_1" and srv[0]["dataset"] == "humaneval"
    assert srv[0]["speedup"] == 0.5 and srv[0]["speed_prompts"] == 16
    md = markdown(rows, srv)
    assert "| instep | dspark-jax | verifier in the step | 42 | 1.750 | 2.250 | 2.500 |" in md
    assert (
        "| Q4_1 | humaneval | 164 | 2.500 | 2.498 | exact 163, drafter_near_tie 1 | "
        "50.0 / 100.0 | 0.50 |" in md
    )


def test_last_val_without_a_file_is_none(tmp_path):
    assert last_val(tmp_path / "missing.jsonl", "accept_len") is None


def test_an_empty_run_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert "no judge/*/summary.json" in capsys.readouterr().err
