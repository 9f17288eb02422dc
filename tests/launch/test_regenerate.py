"""launch/regenerate.py: format kept, history modes, resume after a kill, the sidecar,
the OpenAI-compatible requests, the HF backend on the demo verifier."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launch import regenerate as rg

CONVS = [
    {
        "id": "a",
        "kind": "write",
        "conversations": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "orig1"},
        ],
    },
    {
        "id": "b",
        "kind": "multi",
        "conversations": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "origA"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "origB", "tool_calls": []},
        ],
    },
    {
        "id": "c",
        "messages": [{"role": "user", "content": "m"}, {"role": "assistant", "content": "x"}],
    },
]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _echo_backend(calls):
    """A deterministic verifier: answers with the history it was given."""

    def backend(prompts, first_index):
        calls.append((first_index, prompts))
        return [("|".join(m["content"] for m in p), "stop") for p in prompts]

    return backend


def _args(tmp_path, *extra):
    return rg.parse_args(
        ["--data", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out" / "regen.jsonl"),
         "--model", "verifier", "--backend", "hf", "--chunk-size", "1", *extra]
    )  # fmt: skip


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("history", ["regenerated", "original"])
def test_format_is_kept_and_each_turn_sees_the_chosen_history(tmp_path, history):
    _write(tmp_path / "in.jsonl", CONVS)
    calls = []
    summary = rg.run(_args(tmp_path, "--history", history), backend=_echo_backend(calls))
    out = _read(tmp_path / "out" / "regen.jsonl")
    assert [r.get("id") for r in out] == ["a", "b", "c"]
    # Every field and every non-assistant turn as it was; only assistant contents change.
    for old, new in zip(CONVS, out, strict=True):
        key = "conversations" if "conversations" in old else "messages"
        assert set(new) == set(old)
        assert {k: v for k, v in new.items() if k != key} == {
            k: v for k, v in old.items() if k != key
        }
        assert [t["role"] for t in new[key]] == [t["role"] for t in old[key]]
        for o, n in zip(old[key], new[key], strict=True):
            if o["role"] != "assistant":
                assert n == o
    assert out[0]["conversations"][2]["content"] == "sys|u1"
    b = out[1]["conversations"]
    assert b[1]["content"] == "q1"
    # DeepSpec's rule: turn 2 follows the regenerated turn 1 ("q1"), not "origA".
    assert b[3]["content"] == ("q1|q1|q2" if history == "regenerated" else "q1|origA|q2")
    assert "tool_calls" not in b[3]
    assert summary["assistant_turns_regenerated"] == 4 and summary["failed"] == {}
    side = json.loads((tmp_path / "out" / "regen.jsonl.regenerate.json").read_text())
    assert side["settings"]["history"] == history
    assert side["settings"]["sampling"] == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
        "max_new_tokens": 4096, "seed": 0,
    }  # fmt: skip
    assert not (tmp_path / "out" / "regen.jsonl.partial").exists()


def test_resume_after_a_kill_redoes_only_the_unfinished_chunk(tmp_path):
    """Killed during conversation 2 (after 0 and 1 were committed, mid-write of a line):
    the rerun asks only for conversation 2 and the output equals an uninterrupted run's."""
    _write(tmp_path / "in.jsonl", CONVS)

    class Killed(BaseException):
        pass

    calls = []
    echo = _echo_backend(calls)

    def dying(prompts, first_index):
        if first_index == 2:
            raise Killed
        return echo(prompts, first_index)

    with pytest.raises(Killed):
        rg.run(_args(tmp_path), backend=dying)
    partial = tmp_path / "out" / "regen.jsonl.partial"
    assert not (tmp_path / "out" / "regen.jsonl").exists()
    with partial.open("a") as fh:
        fh.write('{"index": 2, "rec')  # a line cut by the kill
    # Another setting is refused (one line naming the file and the setting).
    with pytest.raises(
        ValueError, match=r"regen.jsonl.partial was written with other settings \(sampling\)"
    ):
        rg.run(_args(tmp_path, "--temperature", "0.5"), backend=echo)
    calls.clear()
    # Resumed against the same model served at another address (a restarted server).
    rg.run(_args(tmp_path, "--endpoint", "http://127.0.0.1:9/v1"), backend=echo)
    assert [first for first, _ in calls] == [2]
    resumed = (tmp_path / "out" / "regen.jsonl").read_text()
    whole = tmp_path / "whole"
    whole.mkdir()
    _write(whole / "in.jsonl", CONVS)
    rg.run(_args(whole), backend=_echo_backend([]))
    assert resumed == (whole / "out" / "regen.jsonl").read_text()
    # Done: a rerun reads the sidecar and does nothing; a foreign output is refused.
    calls.clear()
    rg.run(_args(tmp_path), backend=echo)
    assert calls == []
    rg.run(_args(tmp_path, "--endpoint", "http://127.0.0.1:9/v1"), backend=echo)  # moved server
    assert calls == []
    (tmp_path / "out" / "regen.jsonl.regenerate.json").unlink()
    with pytest.raises(ValueError, match="regen.jsonl exists"):
        rg.run(_args(tmp_path), backend=echo)


def test_failed_conversations_are_left_out_and_named(tmp_path):
    _write(tmp_path / "in.jsonl", CONVS)

    def backend(prompts, first_index):
        return [(None, "HTTPStatusError: 400") if first_index == 1 else ("ok", "length")] * len(
            prompts
        )

    summary = rg.run(_args(tmp_path), backend=backend)
    assert [r["id"] for r in _read(tmp_path / "out" / "regen.jsonl")] == ["a", "c"]
    assert summary["failed"] == {"1": {"id": "b", "error": "HTTPStatusError: 400"}}
    assert summary["assistant_turns_cut_at_max_new_tokens"] == 2


def test_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "no turns"}\n')
    assert rg.main(["--data", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                    "--model", "m"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "in.jsonl: line 1 has no 'conversations'" in err


def test_openai_backend_requests(tmp_path):
    """Chat completions with the sampling parameters, many in flight; HTTP errors after
    retries fail the conversation, not the run."""
    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            if body["messages"][-1]["content"] == "q2":
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b"bad request")
                return
            answer = {"choices": [{"message": {"role": "assistant", "content": "A"},
                                   "finish_reason": "stop"}]}  # fmt: skip
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        _write(tmp_path / "in.jsonl", CONVS)
        args = rg.parse_args(
            ["--data", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
             "--model", "org/verifier", "--backend", "openai",
             "--endpoint", f"http://127.0.0.1:{httpd.server_address[1]}/v1",
             "--temperature", "0.6", "--top-k", "5", "--max-new-tokens", "7",
             "--chat-template-kwargs", '{"enable_thinking": false}', "--max-retries", "0"]
        )  # fmt: skip
        summary = rg.run(args)
    finally:
        httpd.shutdown()
    path, body = seen[0]
    assert path == "/v1/chat/completions"
    assert body["model"] == "org/verifier" and body["max_tokens"] == 7
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.6, 0.8, 5, 0.0)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert [r["id"] for r in _read(tmp_path / "o.jsonl")] == ["a", "c"]
    assert list(summary["failed"]) == ["1"] and "HTTP 400" in summary["failed"]["1"]["error"]


def test_hf_backend_on_the_demo_verifier(tmp_path, verifier_path):
    """Left-padded batches of prompts of different lengths; greedy is deterministic and
    the same alone or batched."""
    _write(tmp_path / "in.jsonl", CONVS[:2])
    argv = ["--model", verifier_path, "--backend", "hf", "--max-new-tokens", "6",
            "--temperature", "0", "--device", "cpu"]  # fmt: skip
    outs = {}
    for name, batch in (("batched", "8"), ("alone", "1")):
        args = rg.parse_args(
            ["--data", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"{name}.jsonl"),
             "--batch-size", batch, *argv]
        )  # fmt: skip
        summary = rg.run(args)
        outs[name] = _read(tmp_path / f"{name}.jsonl")
        assert summary["assistant_turns_regenerated"] == 3
    assert outs["batched"] == outs["alone"]
    assert outs["batched"][0]["conversations"][2]["content"] != "orig1"


def test_sampler_truncations():
    """top-k, then top-p (a token is dropped once the ones before it reach p), then min-p
    (relative to the top probability); temperature 0 is argmax."""
    import torch

    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15]])
    logits = probs.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)

    def drawn(*flags):
        args = rg.parse_args(["--data", "d", "--output", "o", "--model", "m", *flags])
        return set(rg._sample(logits, args, gen).tolist())

    assert drawn("--temperature", "0") == {1}
    assert drawn("--temperature", "1", "--top-k", "0", "--top-p", "1") == {0, 1, 2, 3}
    assert drawn("--temperature", "1", "--top-k", "2", "--top-p", "1") == {1, 2}
    # cumulative before each, sorted: 0, 0.5, 0.8, 0.95 -> p = 0.6 keeps two, 0.85 three.
    assert drawn("--temperature", "1", "--top-k", "0", "--top-p", "0.6") == {1, 2}
    assert drawn("--temperature", "1", "--top-k", "0", "--top-p", "0.85") == {1, 2, 3}
    # min-p 0.5: keep p >= 0.25 (0.5, 0.3).
    assert drawn("--temperature", "1", "--top-k", "0", "--top-p", "1", "--min-p", "0.5") == {1, 2}
