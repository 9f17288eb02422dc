"""A drafter trained here, served by llama.cpp's own server (built from the pinned sdist):
its served text is the verifier's greedy text, and its counters (drafts, drafted and
accepted tokens, per position) equal the served-equivalent walk's exactly
(dspark_jax/eval/predict.py, llama.cpp's rules). Both sides run the drafter and the
verifier in fp32 (the GGUFs are f32, the draft KV cache f32): an engine's accumulation
order can flip the drafter's argmax only at a near-tie, which these few steps do not meet
(every disagreement would show in the per-request counters, asserted one by one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.served.fixtures import ROOT, VERIFIER, heldout_prompts

pytestmark = pytest.mark.served
PROMPTS = 3
MAX_NEW = 64


@pytest.fixture(scope="module")
def llama_server():
    path = os.environ.get("DSPARK_LLAMA_SERVER")
    if not path or not shutil.which(path):
        pytest.skip("DSPARK_LLAMA_SERVER does not name a llama-server binary")
    return path


def test_llamacpp_serves_what_the_walk_predicts(served_drafter, llama_server, tmp_path):
    from dspark_jax.convert.llamacpp_rules import DRAFT_GGUF
    from dspark_jax.eval.predict import ResponsePredictor
    from launch.engines import servers

    export = tmp_path / "export"
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], cwd=ROOT, check=True,  # noqa: E731
                                    capture_output=True, text=True)  # fmt: skip
    out = run("converters", "export", str(served_drafter), str(export), "--target", "llama.cpp",
              "--verifier-path", str(VERIFIER), "--dtype", "float32")  # fmt: skip
    assert "llama-server" in out.stdout  # the check's command
    run("launch.llamacpp_gguf", "--verifier", str(VERIFIER), "--out", str(tmp_path / "v.gguf"))
    predictor = ResponsePredictor(export, VERIFIER, seq_len=256, engine="llama.cpp",
                                  max_new_tokens=MAX_NEW)  # fmt: skip
    n = predictor.ev.num_draft
    eos = set(predictor.ev.settings.eos_ids)
    total_served, total_pred = None, {"drafts": 0, "accepted": 0}
    with servers.start_llamacpp(tmp_path / "v.gguf", export / DRAFT_GGUF, n,
                                tmp_path / "server.log", binary=llama_server,
                                extra=["-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32"]) as server:  # fmt: skip
        start = server.metrics()
        for prompt in heldout_prompts(PROMPTS):
            before = server.metrics()
            got = server.complete(list(prompt), MAX_NEW)
            response = got["tokens"]
            if got["stop"] == "eos":  # it ended on an end-of-sequence token (returned with it)
                assert response[-1] in eos, response[-8:]
            after = server.settle(before, drafted=bool(got.get("timings", {}).get("draft_n")))
            served = servers.difference(before, after)
            pred = predictor.predict(prompt, response)
            # The served text is the verifier's greedy continuation: the fp32 argmax at every
            # token, or within the two forwards' rounding of it (predict.py's bound). The
            # walk compares drafts with the served tokens, so it stays exact either way.
            assert all(m["near_tie"] for m in pred.mismatches), pred.mismatches
            c = pred.counters
            assert (served["drafts"], served["draft_tokens"], served["accepted"]) == (
                c["drafts"],
                c["draft_tokens"],
                c["accepted"],
            ), (served, c)
            assert served["accepted_per_pos"] == c["accepted_per_pos"]
            total_pred["drafts"] += c["drafts"]
            total_pred["accepted"] += c["accepted"]
        total_served = servers.difference(start, server.metrics())
    assert total_served["drafts"] == total_pred["drafts"] > 0
    assert total_served["accepted"] == total_pred["accepted"] > 0
