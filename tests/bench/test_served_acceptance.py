"""bench/served_acceptance.py: vLLM 0.33.0's /metrics parsed (a text written by
prometheus_client with SpecDecodingProm's names and labels), the served acceptance of the
drafts between two scrapes, and one run against a stand-in HTTP server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from bench.served_acceptance import (
    MetricsError,
    main,
    predicted_acceptance,
    served_acceptance,
    spec_decode_counts,
)

LABELS = ["model_name", "engine"]  # vllm/v1/metrics/loggers.py


def metrics_text(per_engine: dict[str, tuple[int, int, int, list[int]]], model="m") -> str:
    """/metrics as vLLM 0.33.0 exposes it: {engine: (drafts, draft_tokens, accepted, per_pos)}."""
    reg = CollectorRegistry()
    names = ("drafts", "draft_tokens", "accepted_tokens")
    counters = [
        Counter(f"vllm:spec_decode_num_{n}", n, labelnames=LABELS, registry=reg) for n in names
    ]
    pos = Counter(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "per pos",
        labelnames=[*LABELS, "position"],
        registry=reg,
    )
    Counter("vllm:prompt_tokens", "other", labelnames=LABELS, registry=reg).labels(model, "0").inc(
        7
    )
    for engine, (drafts, tokens, accepted, per_pos) in per_engine.items():
        for c, v in zip(counters, (drafts, tokens, accepted), strict=True):
            c.labels(model, engine).inc(v)
        for i, v in enumerate(per_pos):
            pos.labels(model, engine, str(i)).inc(v)
    return generate_latest(reg).decode()


def test_counts_sum_over_engines():
    text = metrics_text({"0": (10, 40, 25, [9, 7, 5, 4]), "1": (5, 20, 3, [2, 1, 0, 0])})
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0' in text
    got = spec_decode_counts(text)
    assert got == {
        "drafts": 15,
        "draft_tokens": 60,
        "accepted": 28,
        "accepted_per_pos": [11, 8, 5, 4],
    }
    assert spec_decode_counts(text, model_name="m") == got
    with pytest.raises(MetricsError, match=r"no vllm:spec_decode_num_accepted_tokens_total.*'x'"):
        spec_decode_counts(text, model_name="x")


def test_served_acceptance_is_the_difference_of_two_scrapes():
    before = spec_decode_counts(metrics_text({"0": (10, 40, 25, [9, 7, 5, 4])}))
    after = spec_decode_counts(metrics_text({"0": (30, 120, 55, [19, 15, 12, 9])}))
    s = served_acceptance(before, after)
    assert s["drafts"] == 20 and s["accepted"] == 30
    assert s["acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert s["per_position"] == pytest.approx([10 / 20, 8 / 20, 7 / 20, 5 / 20])
    assert sum(s["accepted_per_pos"]) == s["accepted"]
    with pytest.raises(MetricsError, match="no drafts"):
        served_acceptance(before, before)


def test_no_spec_decode_counters_is_one_line():
    reg = CollectorRegistry()
    Counter("vllm:prompt_tokens", "x", labelnames=LABELS, registry=reg).labels("m", "0").inc()
    with pytest.raises(MetricsError) as e:
        spec_decode_counts(generate_latest(reg).decode())
    assert "\n" not in str(e.value) and "speculative config" in str(e.value)


def _summary(tmp_path):
    curve = {"acceptance_length": 2.25, "cumulative": [0.6, 0.4, 0.2, 0.05], "blocks": 80}
    path = tmp_path / "summary.json"
    path.write_text(
        json.dumps({"datasets": {"heldout": {"acceptance": {"greedy/free_running": curve}}}})
    )
    return path


def test_run_against_a_stand_in_server(tmp_path, capsys):
    """Two conversations: the script sends the prompt turns greedy, scrapes before/after."""
    state = {"requests": [], "scrapes": 0}
    scrapes = [
        metrics_text({"0": (4, 16, 2, [2, 0, 0, 0])}),
        metrics_text({"0": (14, 56, 17, [8, 5, 3, 1])}),
    ]

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: bytes, kind="application/json"):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(json.dumps({"data": [{"id": "org/v"}]}).encode())
            else:
                self._send(scrapes[min(state["scrapes"], 1)].encode(), "text/plain")
                state["scrapes"] += 1

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append(req)
            out = {"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 3}}
            self._send(json.dumps(out).encode())

        def log_message(self, *a):
            pass

    prompts = tmp_path / "p.jsonl"
    conv = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "dataset answer"},
    ]
    prompts.write_text(
        json.dumps({"id": "a", "conversations": conv})
        + "\n"
        + json.dumps({"id": "b", "conversations": conv[1:]})
        + "\n"
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = [
            "--endpoint",
            url,
            "--prompts",
            str(prompts),
            "--max-tokens",
            "8",
            "--answers-out",
            str(tmp_path / "ans.jsonl"),
            "--predicted",
            str(_summary(tmp_path)),
        ]
        assert main(argv) == 0
    finally:
        server.shutdown()
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1
    out = json.loads(line[0])
    assert out["served"]["acceptance_length"] == pytest.approx(1 + 15 / 10)
    assert out["served"]["per_position"] == pytest.approx([0.6, 0.5, 0.3, 0.1])
    assert out["predicted"]["acceptance_length"] == 2.25
    assert out["gap"] == pytest.approx(2.5 - 2.25)
    assert [r["messages"] for r in state["requests"]] == [conv[:2], conv[1:2]]
    assert all(r["temperature"] == 0.0 and r["model"] == "org/v" for r in state["requests"])
    answers = [json.loads(x) for x in (tmp_path / "ans.jsonl").read_text().splitlines()]
    assert answers[0]["conversations"][-1] == {"role": "assistant", "content": "ok"}


def test_predicted_needs_a_dataset_name(tmp_path):
    path = _summary(tmp_path)
    assert predicted_acceptance(path, None)["blocks"] == 80
    with pytest.raises(ValueError, match="no dataset 'code'"):
        predicted_acceptance(path, "code")
