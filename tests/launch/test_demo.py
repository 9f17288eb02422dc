"""The committed demo verifier and corpus: a real small Qwen3 whose next-token
distributions are structured, with the tokenizer DSpark needs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import torch

from launch.demo_corpus import build_conversations, extract_functions

from .conftest import DEMO, REPO


def test_demo_verifier_files(verifier_path, demo_tokenizer):
    cfg = json.loads((DEMO / "verifier" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["num_hidden_layers"] == 4 and cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is False
    tok_cfg = json.loads((DEMO / "verifier" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]  # stored in tokenizer_config.json
    assert demo_tokenizer.mask_token == "<|mask|>" and demo_tokenizer.mask_token_id == 3
    assert len(demo_tokenizer) == cfg["vocab_size"] == 4096
    log = json.loads((DEMO / "verifier" / "training_log.json").read_text())
    assert log["mask_token_id"] == 3


def test_demo_verifier_predictions_are_structured(extractor, demo_tokenizer):
    """On held-out conversations the verifier's next-token distribution over the
    assistant turns is far from uniform (entropy well below log V = 8.3 nats) and its
    top-1 guess is often right. (Measured over the first 40: entropy 3.96 nats,
    cross entropy 3.77, top-1 34%.)"""
    with open(DEMO / "conversations_heldout.jsonl", encoding="utf-8") as fh:
        convs = [json.loads(line)["conversations"] for line in fh][:6]
    ent, ce, acc, n = 0.0, 0.0, 0.0, 0
    for conv in convs:
        text = demo_tokenizer.apply_chat_template(conv, tokenize=False)
        ids = demo_tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = demo_tokenizer.apply_chat_template(
            conv[:-1], tokenize=False, add_generation_prompt=True
        )
        start = len(demo_tokenizer(prompt, add_special_tokens=False)["input_ids"])
        with torch.inference_mode():
            logits = extractor.model(input_ids=torch.tensor([ids])).logits[0].float()
        pred, target = logits[start - 1 : -1], torch.tensor(ids[start:])
        logp = pred.log_softmax(-1)
        ent += -(logp.exp() * logp).sum().item()
        ce += torch.nn.functional.cross_entropy(pred, target, reduction="sum").item()
        acc += (pred.argmax(-1) == target).sum().item()
        n += len(target)
    ent, ce, acc = ent / n, ce / n, acc / n
    assert ent < 0.6 * math.log(len(demo_tokenizer)), ent
    assert ce < 4.5 and acc > 0.2, (ce, acc)


def test_corpus_builder(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text(
        textwrap.dedent('''
        class A:
            def f(self, x):
                """Return x plus one.

                More text.
                """
                y = x + 1
                return y

        def g(a, b=2):
            """Add."""
            c = a + b
            return c
        ''')
    )
    fns = extract_functions(src)
    assert [f["qual"] for f in fns] == ["A.f", "g"]
    assert fns[0]["sig"] == "(self, x)" and fns[0]["summary"] == "Return x plus one."
    assert '"""' not in fns[0]["bare"] and fns[0]["code"].startswith("def f(self, x):")
    a, b = build_conversations(fns, seed=0), build_conversations(fns, seed=0)
    assert a == b  # seeded
    for c in a:
        roles = [t["role"] for t in c["conversations"]]
        assert roles[-1] == "assistant" and "user" in roles


# Stands in for the demo's python: records each module it is asked to run and creates
# the file that step's Makefile target names; training writes run.yaml first, as the
# trainer does, and exits with $FAKE_TRAIN_RC.
FAKE_PYTHON = """#!{python}
import os, pathlib, sys
args = sys.argv[1:]
module = args[1]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(module + "\\n")
def opt(name):
    return pathlib.Path(args[args.index(name) + 1])
def touch(path, text="{{}}"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
if module == "launch.extract_hidden_states":
    touch(opt("--preprocessed-data") / "hidden_states" / "extraction_config.json")
elif module == "dspark_jax.train":
    touch(pathlib.Path(os.environ["FAKE_SAVE_PATH"]) / "run.yaml")  # written at start
    sys.exit(int(os.environ["FAKE_TRAIN_RC"]))
elif module == "converters" and args[2] == "export":
    touch(pathlib.Path(args[4]) / "config.json")
    touch(pathlib.Path(args[4]) / "README.md", "the card")
elif module == "dspark_jax.eval":
    touch(opt("--output-dir") / "summary.json")
    touch(opt("--output-dir") / "acceptance.md", "the table")
"""


def test_make_demo_never_exports_an_unfinished_training(tmp_path):
    """Issue 18.5: the trainer exits 143 on SIGTERM; make stops there, and the next
    `make demo` trains again (resumes) before evaluating and exporting."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    demo, log = tmp_path / "demo", tmp_path / "calls.txt"

    def make(train_rc: int) -> subprocess.CompletedProcess:
        env = dict(os.environ, FAKE_LOG=str(log), FAKE_TRAIN_RC=str(train_rc),
                   FAKE_SAVE_PATH=str(demo / "checkpoints"))  # fmt: skip
        return subprocess.run(["make", "-C", str(REPO), "demo", f"PY={fake}", f"DEMO={demo}"],
                              env=env, capture_output=True, text=True, timeout=120)  # fmt: skip

    first = make(143)
    assert first.returncode != 0
    calls = log.read_text().split()
    assert calls[-1] == "dspark_jax.train" and "converters" not in calls
    assert not (demo / "checkpoints" / "training_complete").exists()
    second = make(0)
    assert second.returncode == 0, second.stderr
    calls = log.read_text().split()
    assert calls.count("dspark_jax.train") == 2
    # train, then eval (the calibration the export folds in), then export and check
    last_train = len(calls) - 1 - calls[::-1].index("dspark_jax.train")
    assert last_train < calls.index("dspark_jax.eval") < calls.index("converters")
    assert calls[-3:] == ["dspark_jax.eval", "converters", "converters"]
    assert (demo / "checkpoints" / "training_complete").exists()
    assert "the card" in second.stdout
