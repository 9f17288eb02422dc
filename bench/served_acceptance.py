"""Served acceptance vs predicted acceptance: confirm a drafter after deployment.

    python bench/served_acceptance.py --engine vllm --endpoint http://localhost:8000 \
        [--prompts configs/demo/conversations_heldout.jsonl] [--max-tokens 256] \
        [--answers-out runs/served/conversations.jsonl] \
        [--predicted runs/served/eval/summary.json --dataset heldout]

Sends each held-out conversation's prompt (the turns before its first assistant turn) to
a running ``vllm serve`` (either form ``converters check`` prints) through
``/v1/chat/completions`` (the server applies the verifier's chat template), greedy
(temperature 0), one request at a time; reads vLLM 0.33.0's speculative-decoding
counters from its Prometheus ``/metrics`` before and after (``vllm/v1/spec_decode/
metrics.py``: ``SpecDecodingProm``; labels ``model_name``, ``engine`` from
``vllm/v1/metrics/loggers.py``, summed over engines) and computes the served
acceptance length ``1 + accepted / drafts`` and, per draft position ``i``, the share of
drafts accepted through it (``accepted_per_pos[i] / drafts``). Only the difference of the
two scrapes counts, so other traffic on the server during the run biases the result:
run it on an idle server.

The answers are the verifier's own greedy answers (speculative decoding with greedy
verification returns exactly those): ``--answers-out`` writes them as conversations, to
prepare and evaluate with ``python -m dspark_jax.eval`` (README, "Serve"); ``--predicted``
reads that eval's ``summary.json`` and puts its greedy, free-running acceptance (the
Markov head on the drafter's own tokens, as the engine drafts) beside the served one.
The eval scores every anchor of the answers, the engine only the anchors decoding
reaches (one per verification step), so the two agree up to that sampling, not exactly.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# vLLM 0.33.0 counter names (vllm/v1/spec_decode/metrics.py, SpecDecodingProm).
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class MetricsError(ValueError):
    """A /metrics text without the speculative-decoding counters."""


def spec_decode_counts(text: str, model_name: str | None = None) -> dict:
    """vLLM 0.33.0's speculative-decoding counters in a Prometheus ``/metrics`` text.

    Returns ``{"drafts", "draft_tokens", "accepted": int, "accepted_per_pos": [int]}``,
    summed over engines (the ``engine`` label); ``model_name``: only that served model's.
    """
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    seen = set()
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue  # the _created timestamps of each counter
            name = s.name[: -len("_total")]
            if model_name is not None and s.labels.get("model_name") != model_name:
                continue
            if name in totals:
                totals[name] += s.value
                seen.add(name)
            elif name == ACCEPTED_PER_POS:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    missing = sorted(set(totals) - seen)
    if missing:
        who = f" for model_name={model_name!r}" if model_name else ""
        raise MetricsError(
            f"/metrics has no {', '.join(m + '_total' for m in missing)}{who}: is the "
            "server running with a speculative config (vLLM 0.33)?"
        )
    n = max(per_pos) + 1 if per_pos else 0
    return {
        "drafts": round(totals[DRAFTS]),
        "draft_tokens": round(totals[DRAFT_TOKENS]),
        "accepted": round(totals[ACCEPTED]),
        "accepted_per_pos": [round(per_pos.get(i, 0.0)) for i in range(n)],
    }


def served_acceptance(before: dict, after: dict) -> dict:
    """Acceptance of the drafts made between two :func:`spec_decode_counts` scrapes."""
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    n = len(after["accepted_per_pos"])
    prev = before["accepted_per_pos"] + [0] * (n - len(before["accepted_per_pos"]))
    pos = [a - b for a, b in zip(after["accepted_per_pos"], prev, strict=True)]
    if d["drafts"] <= 0:
        raise MetricsError("no drafts were made between the two /metrics scrapes")
    return {
        **d,
        "acceptance_length": 1.0 + d["accepted"] / d["drafts"],
        "per_position": [p / d["drafts"] for p in pos],  # accepted through position i
        "accepted_per_pos": pos,
    }


def predicted_acceptance(summary_path: str | os.PathLike, dataset: str | None) -> dict:
    """``python -m dspark_jax.eval``'s greedy free-running acceptance from summary.json."""
    summary = json.loads(Path(summary_path).read_text())
    datasets = summary.get("datasets") or {}
    if dataset is None:
        if len(datasets) != 1:
            raise ValueError(
                f"{summary_path}: datasets {sorted(datasets)}; choose one with --dataset"
            )
        dataset = next(iter(datasets))
    if dataset not in datasets:
        raise ValueError(f"{summary_path}: no dataset {dataset!r} (has {sorted(datasets)})")
    curve = datasets[dataset]["acceptance"]["greedy/free_running"]
    return {
        "dataset": dataset,
        "acceptance_length": curve["acceptance_length"],
        "per_position": curve["cumulative"],
        "blocks": curve["blocks"],
    }


def prompt_turns(conversation: list[dict]) -> list[dict]:
    """The turns before the first assistant turn (the prompt the verifier answers)."""
    out = []
    for turn in conversation:
        if turn["role"] == "assistant":
            break
        out.append({"role": turn["role"], "content": turn["content"]})
    return out


def _http(url: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def run(args: argparse.Namespace) -> dict:
    base = args.endpoint.rstrip("/")
    model = args.model or json.loads(_http(f"{base}/v1/models"))["data"][0]["id"]
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line]
    rows = rows[: args.limit] if args.limit else rows
    before = spec_decode_counts(_http(f"{base}/metrics").decode(), args.metrics_model)
    answers, completion_tokens, t0 = [], 0, time.perf_counter()
    for row in rows:
        turns = prompt_turns(row["conversations"])
        out = json.loads(
            _http(
                f"{base}/v1/chat/completions",
                {
                    "model": model,
                    "messages": turns,
                    "temperature": 0.0,
                    "max_tokens": args.max_tokens,
                },
            )
        )
        completion_tokens += out["usage"]["completion_tokens"]
        text = out["choices"][0]["message"]["content"]
        answers.append(
            {"id": row.get("id"), "conversations": [*turns, {"role": "assistant", "content": text}]}
        )
    wall = time.perf_counter() - t0
    after = spec_decode_counts(_http(f"{base}/metrics").decode(), args.metrics_model)
    served = served_acceptance(before, after)
    if args.answers_out:
        Path(args.answers_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.answers_out).write_text("".join(json.dumps(a) + "\n" for a in answers))
    result = {
        "bench": "served_acceptance",
        "engine": args.engine,
        "endpoint": base,
        "model": model,
        "prompts": len(rows),
        "max_tokens": args.max_tokens,
        "completion_tokens": completion_tokens,
        "wall_s": round(wall, 3),
        "served": served,
    }
    if args.predicted:
        pred = predicted_acceptance(args.predicted, args.dataset)
        result["predicted"] = pred
        result["gap"] = served["acceptance_length"] - pred["acceptance_length"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm",), default="vllm")
    p.add_argument("--endpoint", required=True, help="the server's base URL")
    p.add_argument("--model", help="served model name (default: the first of /v1/models)")
    p.add_argument("--metrics-model", help="count only this model_name label (default: all models)")
    p.add_argument("--prompts", default="configs/demo/conversations_heldout.jsonl")
    p.add_argument("--limit", type=int, default=0, help="first N conversations (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--answers-out", help="write the verifier's answers as conversations jsonl")
    p.add_argument("--predicted", help="summary.json of python -m dspark_jax.eval")
    p.add_argument("--dataset", help="the summary's dataset (default: its only one)")
    args = p.parse_args(argv)
    try:
        result = run(args)
    except (MetricsError, ValueError, urllib.error.URLError, OSError, KeyError) as e:
        print(f"served_acceptance: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
