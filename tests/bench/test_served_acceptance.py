"""The engines' /metrics counters (launch/engines/servers.py: vLLM's, written by
prometheus_client with SpecDecodingProm's names and labels, and llama.cpp's own text) and
how bench/served_acceptance.py explains a prompt whose counters differ from the walk's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from bench.served_acceptance import explain, prompt_turns
from launch.engines.servers import difference, spec_counts

LABELS = ["model_name", "engine"]  # vllm/v1/metrics/loggers.py


def vllm_metrics(per_engine: dict[str, tuple[int, int, int, list[int]]], model="m") -> str:
    """/metrics as vLLM exposes it: {engine: (drafts, draft_tokens, accepted, per_pos)}."""
    reg = CollectorRegistry()
    names = ("drafts", "draft_tokens", "accepted_tokens")
    counters = [
        Counter(f"vllm:spec_decode_num_{n}", n, labelnames=LABELS, registry=reg) for n in names
    ]
    pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos",
                  labelnames=[*LABELS, "position"], registry=reg)  # fmt: skip
    Counter("vllm:prompt_tokens", "other", labelnames=LABELS, registry=reg).labels(model, "0").inc(
        7
    )
    for engine, (drafts, tokens, accepted, per_pos) in per_engine.items():
        for c, v in zip(counters, (drafts, tokens, accepted), strict=True):
            c.labels(model, engine).inc(v)
        for i, v in enumerate(per_pos):
            pos.labels(model, engine, str(i)).inc(v)
    return generate_latest(reg).decode()


# llama.cpp's /metrics (tools/server/server-task.cpp ~1565-1625), as llama-server prints it.
LLAMACPP = """# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 114
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 12
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 16
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 0
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 10
"""


def test_vllm_counts_sum_over_engines():
    text = vllm_metrics({"0": (10, 40, 25, [9, 7, 5, 4]), "1": (5, 20, 3, [2, 1, 0, 0])})
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0' in text
    assert spec_counts(text, "vllm") == {
        "drafts": 15, "draft_tokens": 60, "accepted": 28, "accepted_per_pos": [11, 8, 5, 4],
    }  # fmt: skip
    assert spec_counts(text, "llama.cpp")["drafts"] == 0  # another engine's names


def test_llamacpp_counts():
    assert spec_counts(LLAMACPP, "llama.cpp") == {
        "drafts": 16, "draft_tokens": 114, "accepted": 12, "accepted_per_pos": [9, 3, 0],
    }  # fmt: skip


def test_difference_of_two_scrapes():
    before = spec_counts(vllm_metrics({"0": (10, 40, 25, [9, 7, 5, 4])}), "vllm")
    after = spec_counts(vllm_metrics({"0": (30, 120, 55, [19, 15, 12, 9])}), "vllm")
    d = difference(before, after)
    assert d == {
        "drafts": 20,
        "draft_tokens": 80,
        "accepted": 30,
        "accepted_per_pos": [10, 8, 7, 5],
    }
    # Positions appear once something was accepted there: a shorter list counts zeros.
    assert difference({**before, "accepted_per_pos": []}, before)["accepted_per_pos"] == [
        9,
        7,
        5,
        4,
    ]


def test_explain():
    s = {"drafts": 5, "accepted": 9, "accepted_per_pos": [4, 3, 2, 0]}
    assert explain("llama.cpp", s, dict(s), 4) == "exact"
    # vLLM counts tokens accepted past the response's end: more accepted, same drafts.
    assert explain("vllm", {**s, "accepted": 12}, s, 4) == "vllm_past_end"
    assert explain("vllm", {**s, "accepted": 14}, s, 4) == "unexplained"  # > one step's draft
    assert explain("llama.cpp", {**s, "accepted": 10}, s, 4) == "unexplained"
    assert explain("vllm", {**s, "drafts": 6}, s, 4) == "unexplained"


def test_prompt_turns_stop_at_the_first_answer():
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]  # fmt: skip
    assert prompt_turns(conv) == conv[:2]
