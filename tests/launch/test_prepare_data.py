"""Issue 4, test 3: prepare_data masks exactly the assistant turn of each row, drops
rows under --minimum-valid-tokens, and matches speculators 0.9.0's prepare-data."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from launch.prepare_data import LocalRenderer, boundary_rows, main, prepare, vocab_maps
from tests.converters.helpers import tree_digest

from .conftest import demo_conversations, write_jsonl

CONV = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write `add(a, b)`."},
    {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"},
    {"role": "user", "content": "And `sub`?"},
    {"role": "tool", "content": '{"ok": true}'},
    {"role": "assistant", "content": "def sub(a, b):\n    return a - b"},
]


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_multi_turn_mask_is_exactly_each_assistant_turn(demo_tokenizer, verifier_path):
    render = LocalRenderer(verifier_path, max_length=4096)
    rows = boundary_rows(CONV, render, 4096)
    assert len(rows) == 2  # one row per assistant turn
    for row, j in zip(rows, (2, 5)):
        ids, mask = row["input_ids"], row["loss_mask"]
        full = demo_tokenizer.apply_chat_template(CONV[: j + 1], tokenize=False)
        assert ids == _encode(demo_tokenizer, full)
        # the supervised tokens are exactly this assistant turn: its text and end marker
        head = demo_tokenizer.apply_chat_template(
            CONV[:j], tokenize=False, add_generation_prompt=True
        )
        n_ctx = len(_encode(demo_tokenizer, head))
        assert mask == [0] * n_ctx + [1] * (len(ids) - n_ctx)
        sup = demo_tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert sup == CONV[j]["content"] + "<|im_end|>\n"
        # earlier assistant turns of the same row are context only
        assert demo_tokenizer.decode(ids[:n_ctx]).endswith("<|im_start|>assistant\n")


def test_minimum_valid_tokens_and_rows(tmp_path, demo_tokenizer, verifier_path):
    short = [{"role": "user", "content": "Ok?"}, {"role": "assistant", "content": "Yes."}]
    n_short = len(_encode(demo_tokenizer, "Yes.<|im_end|>\n"))
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"conversations": CONV},
            {"messages": short},  # the 'messages' spelling
            {"conversations": [{"role": "user", "content": "no answer"}]},  # no assistant: no row
        ],
    )
    ds, stats = prepare(
        verifier_path,
        [str(data)],
        str(tmp_path / "a"),
        seq_length=512,
        minimum_valid_tokens=n_short + 1,
    )
    assert len(ds) == 2 and stats["filtered"] == 1 and stats["kept"] == 2
    ds2, stats2 = prepare(
        verifier_path,
        [str(data)],
        str(tmp_path / "b"),
        seq_length=512,
        minimum_valid_tokens=n_short,
    )
    assert len(ds2) == 3 and stats2["filtered"] == 0
    sums = sorted(int(r["loss_mask"].sum()) for r in ds2)
    assert sums[0] == n_short
    for r in ds2:
        assert r["seq_len"].item() == len(r["input_ids"]) == len(r["loss_mask"])
        assert r["input_ids"].dtype == torch.int64 and r["loss_mask"].dtype == torch.int64


def test_seq_length_truncation_and_pretokenised(tmp_path, verifier_path):
    data = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]},  # unsupervised: dropped
            {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 0, 1]},
        ],
    )
    with pytest.raises(ValueError, match="loss_mask has 5"):
        prepare(verifier_path, [str(data)], str(tmp_path / "x"), seq_length=4)
    write_jsonl(
        data,
        [
            {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]},
        ],
    )
    ds, stats = prepare(verifier_path, [str(data)], str(tmp_path / "y"), seq_length=4)
    assert stats["unsupervised"] == 1
    assert ds[0]["input_ids"].tolist() == [5, 6, 7, 8]
    assert ds[0]["loss_mask"].tolist() == [0, 0, 1, 1]


class _RenderServer:
    """Stand-in for vLLM's /v1/chat/completions/render, rendering with the demo
    tokenizer (template -> text -> encode without special tokens, right-truncated)."""

    def __init__(self, tok):
        tokenizer = tok

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                b = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = tokenizer.apply_chat_template(
                    b["messages"],
                    tools=b.get("tools"),
                    tokenize=False,
                    add_generation_prompt=b["add_generation_prompt"],
                )
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if b.get("truncate_prompt_tokens"):
                    ids = ids[: b["truncate_prompt_tokens"]]
                body = json.dumps({"token_ids": ids}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.reference
def test_matches_speculators_prepare_data(tmp_path, demo_tokenizer, verifier_path):
    from datasets import load_from_disk
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    convs = demo_conversations(30) + [{"conversations": CONV}]
    data = write_jsonl(tmp_path / "c.jsonl", [{"conversations": c["conversations"]} for c in convs])
    server = _RenderServer(demo_tokenizer)
    try:
        ref, _ = load_and_preprocess_dataset(
            verifier_path,
            [str(data)],
            seq_length=200,
            build_dataset_num_proc=1,
            seed=3,
            max_samples=20,
            render_endpoint=server.url,
            minimum_valid_tokens=8,
        )
        # ours, rendering through the same endpoint and locally
        ours_ep, _ = prepare(
            verifier_path,
            [str(data)],
            str(tmp_path / "ep"),
            seq_length=200,
            seed=3,
            max_samples=20,
            render_endpoint=server.url,
            minimum_valid_tokens=8,
        )
    finally:
        server.close()
    rc = main(
        [
            "--model",
            verifier_path,
            "--data",
            str(data),
            "--output",
            str(tmp_path / "loc"),
            "--seq-length",
            "200",
            "--seed",
            "3",
            "--max-samples",
            "20",
            "--minimum-valid-tokens",
            "8",
            "--num-preprocessing-workers",
            "1",
            "--draft-vocab-size",
            "64",
        ]
    )
    assert rc == 0
    ours = load_from_disk(str(tmp_path / "loc"))
    ref_path = tmp_path / "ref"
    ref.save_to_disk(str(ref_path))
    ref = load_from_disk(str(ref_path))
    assert len(ref) == 20
    for cand in (ours, ours_ep):
        assert len(cand) == len(ref)
        assert cand.features == ref.features
        assert cand.format["type"] == ref.format["type"] == "torch"
        for a, b in zip(cand, ref):
            for k in ("input_ids", "loss_mask", "seq_len"):
                assert torch.equal(a[k], b[k]), k

    # token counts and vocab maps
    save_token_frequency_distribution(ref, tmp_path / "ref_freq.pt")
    ref_freq = torch.load(tmp_path / "ref_freq.pt", weights_only=True)
    our_freq = torch.load(tmp_path / "loc" / "token_freq.pt", weights_only=True)
    assert our_freq == ref_freq
    counts = np.load(tmp_path / "loc" / "token_counts.npy")
    assert counts.shape == (len(demo_tokenizer),) and counts.dtype == np.int64
    assert {i: int(c) for i, c in enumerate(counts) if c} == ref_freq
    d2t_ref, t2d_ref = build_vocab_mappings_from_distribution(ref_freq, 64, len(demo_tokenizer))
    d2t = np.load(tmp_path / "loc" / "d2t-64.npy")
    t2d = np.load(tmp_path / "loc" / "t2d-64.npy")
    assert np.array_equal(d2t, d2t_ref.numpy()) and np.array_equal(t2d, t2d_ref.numpy())
    # a rare-token case that needs padding with unused ids
    d2t_s, t2d_s = vocab_maps({7: 3, 2: 3, 9: 1}, 5, 12)
    r_d2t, r_t2d = build_vocab_mappings_from_distribution({7: 3, 2: 3, 9: 1}, 5, 12)
    assert np.array_equal(d2t_s, r_d2t.numpy()) and np.array_equal(t2d_s, r_t2d.numpy())


def test_cli_skips_existing_output(tmp_path, verifier_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"conversations": CONV}])
    out = tmp_path / "o"
    argv = [
        "--model",
        verifier_path,
        "--data",
        str(data),
        "--output",
        str(out),
        "--num-preprocessing-workers",
        "1",
    ]
    assert main(argv) == 0
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("*.arrow")}
    assert main(argv) == 0  # skipped
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.arrow")} == stamp
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="notes.txt"):
        main([*argv, "--overwrite"])


def test_accepts_the_seed_command():
    """docs/seed_run.md, "Prepare data"."""
    from launch.prepare_data import parse_args

    a = parse_args(
        "--model moonshotai/Kimi-K3 --trust-remote-code --data ./data.jsonl "
        "--output ./runs/kimi_k3_dspark/data --seq-length 8192 "
        "--num-preprocessing-workers 48 --minimum-valid-tokens 16".split()
    )
    assert (
        a.model,
        a.trust_remote_code,
        a.data,
        a.seq_length,
        a.num_preprocessing_workers,
        a.minimum_valid_tokens,
    ) == ("moonshotai/Kimi-K3", True, ["./data.jsonl"], 8192, 48, 16)


def test_draft_vocab_size_is_checked_first_and_a_rerun_adds_the_maps(
    tmp_path, verifier_path, small_prepared, capsys
):
    """Issue 18.7: a size beyond the vocabulary stops before anything is written (or an
    existing dataset changed); a rerun with a valid size writes the missing maps, the
    ones a first run would have written, and leaves the dataset byte-identical."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"conversations": CONV}])
    base = ["--model", verifier_path, "--data", str(data), "--num-preprocessing-workers", "1"]
    assert main([*base, "--output", str(tmp_path / "new"), "--draft-vocab-size", "5000"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "error: --draft-vocab-size 5000 exceeds the verifier vocabulary (4096 tokens)"
    )
    assert not (tmp_path / "new").exists()

    prepared = tmp_path / "prepared"  # made without --draft-vocab-size
    shutil.copytree(small_prepared, prepared)
    before = tree_digest(prepared)
    for extra in ([], ["--overwrite"]):  # --overwrite would have removed it first
        assert main([*base, "--output", str(prepared), "--draft-vocab-size", "5000", *extra]) == 1
        assert tree_digest(prepared) == before
    assert main([*base, "--output", str(prepared), "--draft-vocab-size", "64"]) == 0
    after = tree_digest(prepared)
    assert set(after) - set(before) == {"d2t-64.npy", "t2d-64.npy"}
    assert {k: after[k] for k in before} == before
    counts = np.load(prepared / "token_counts.npy")
    d2t, t2d = vocab_maps({i: int(c) for i, c in enumerate(counts) if c}, 64, counts.size)
    np.testing.assert_array_equal(np.load(prepared / "d2t-64.npy"), d2t)
    np.testing.assert_array_equal(np.load(prepared / "t2d-64.npy"), t2d)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "the file is empty (expected JSON rows)"),
        ("\n\n", "the file is empty (expected JSON rows)"),
        ('{"conversations": []}\n{"conversations": [\n', "not readable as JSON/JSONL rows ("),
    ],
)
def test_empty_or_malformed_jsonl_is_one_line(tmp_path, verifier_path, capsys, content, message):
    """Issue 18.10: the file is named, nothing is written."""
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    out = tmp_path / "o"
    argv = ["--model", verifier_path, "--data", str(data), "--output", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: --data {data}: {message}"), err
    assert not out.exists()
