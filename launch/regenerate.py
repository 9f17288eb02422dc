"""Regenerate the assistant turns of a conversations file with the verifier itself.

A drafter trained on the verifier's own answers sees at training time the text it
drafts for at serving time (on-policy data; DeepSpec and the DSpark paper regenerate
every response with the target). This keeps every record, its other fields and every
non-assistant turn as they are, and replaces the content of each assistant turn by the
verifier's answer to the turns before it. The output is a conversations JSONL file that
``launch.prepare_data`` reads like the input::

    python -m launch.regenerate --model configs/demo/verifier --backend hf \\
        --data configs/demo/conversations.jsonl --output runs/onpolicy/conversations.jsonl
    python -m launch.regenerate --model Qwen/Qwen3-8B --backend openai \\
        --endpoint http://127.0.0.1:8000/v1 --requests-in-flight 128 \\
        --data train.jsonl --output train_regen.jsonl

Backends: ``openai``, the OpenAI-compatible chat endpoint of ``vllm serve`` (or SGLang,
TGI, ...) with ``--requests-in-flight`` requests at once; ``hf``, transformers'
``generate`` in-process (left-padded batches; CPU and tests).

History (``--history``): a conversation with several assistant turns either answers
each user turn after the *regenerated* earlier answers (``regenerated``, the default:
what DeepSpec's ``scripts/data/generate_train_data.py`` does, appending each new answer
to the history it sends next, so every turn is on-policy) or after the dataset's
*original* answers (``original``: the turns are independent).

Sampling: ``--temperature`` (default 0.7), ``--top-p`` (0.8), ``--top-k`` (20),
``--min-p`` (0): DeepSpec's defaults for Qwen3 (scripts/data/prepare_data.sh), its
``--max-tokens`` is ``--max-new-tokens`` here. ``--temperature 0`` is greedy.

Resume: finished conversations are appended to ``<output>.partial`` (one JSON line each,
flushed and fsynced per chunk of ``--chunk-size`` conversations; a line cut by a kill is
ignored), so a killed run loses at most the chunk in progress and a rerun with the same
flags continues. The partial file starts with the run's settings; another setting is
refused. When every conversation is done, ``<output>`` is written in input order
(temporary file, fsync, rename) with ``<output>.regenerate.json`` beside it: the
settings, the sampling parameters, and counts (turns regenerated, turns cut at
``--max-new-tokens``, conversations that failed and were left out, each named). Then the
partial file is removed. A conversation whose request fails (after ``--max-retries``
HTTP retries) is left out of the output and named in the sidecar; rerun into another
output to try them again.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from launch import attn_implementation as attn_impl
from launch.hs_files import commit_file

log = logging.getLogger("launch.regenerate")

SIDECAR_SUFFIX = ".regenerate.json"
PARTIAL_SUFFIX = ".partial"
FORMAT = "dspark-jax regenerate 1"

# A backend: a list of message lists -> one (text, finish_reason) each, in order
# (finish_reason "length" when cut at --max-new-tokens; text None: failed, with the
# error in the second field).
# The int: a seed offset (the first conversation's index).
Backend = Callable[[list[list[dict]], int], list[tuple[str | None, str]]]


# --------------------------------------------------------------------------- input
def read_conversations(path: Path) -> list[dict]:
    """The records of a JSONL conversations file (``conversations`` or ``messages``)."""
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file (a .jsonl conversations file)")
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--data {path}: line {lineno} is not JSON ({e.msg})") from None
            turns = rec.get("conversations", rec.get("messages")) if isinstance(rec, dict) else None
            if not isinstance(turns, list) or not all(
                isinstance(t, dict) and "role" in t for t in turns
            ):
                raise ValueError(
                    f"--data {path}: line {lineno} has no 'conversations' (or 'messages') "
                    "list of turns with a 'role'"
                )
            records.append(rec)
    return records


def turns_key(rec: dict) -> str:
    return "conversations" if "conversations" in rec else "messages"


def assistant_turns(rec: dict) -> list[int]:
    return [i for i, t in enumerate(rec[turns_key(rec)]) if t.get("role") == "assistant"]


def _prompt_turn(turn: dict) -> dict:
    """A turn as sent to the verifier: role and content only."""
    return {"role": turn["role"], "content": turn.get("content") or ""}


# --------------------------------------------------------------------------- backends
def sampling_params(args: argparse.Namespace) -> dict:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
    }


def openai_backend(args: argparse.Namespace) -> Backend:
    """``POST {endpoint}/chat/completions``, ``--requests-in-flight`` at once."""
    from dspark_jax.data.online.http import HTTPStatusError, InvalidResponseError, post_json, retry

    url = args.endpoint.rstrip("/") + "/chat/completions"
    model = args.served_model_name or args.model
    extra = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else None

    def one(messages: list[dict], index: int) -> tuple[str | None, str]:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "seed": args.seed + index,
            "stream": False,
        }
        if extra:
            body["chat_template_kwargs"] = extra
        try:
            res = retry(
                lambda: post_json(url, body, timeout=args.request_timeout),
                max_retries=args.max_retries,
                backoff=1.0,
                describe=f"POST {url}",
            )
            choice = res["choices"][0]
            text = choice["message"].get("content")
            if not isinstance(text, str):
                raise InvalidResponseError(f"POST {url} -> no message content: {choice}")
            return text, choice.get("finish_reason") or "stop"
        except (HTTPStatusError, InvalidResponseError, KeyError, IndexError, TypeError) as e:
            return None, f"{type(e).__name__}: {e}"

    pool = ThreadPoolExecutor(max_workers=args.requests_in_flight)

    def generate(batch: list[list[dict]], first_index: int = 0) -> list[tuple[str | None, str]]:
        return list(pool.map(one, batch, range(first_index, first_index + len(batch))))

    return generate


def _sample(logits, args: argparse.Namespace, generator):
    """One token per row: greedy at temperature 0, else temperature, top-k, top-p, min-p
    (vLLM's order), then a draw. With top-k the rest works on the k candidates only."""
    import torch

    if args.temperature == 0:
        return logits.argmax(-1)
    logits = logits / args.temperature
    if 0 < args.top_k < logits.shape[-1]:
        logits, cand = torch.topk(logits, args.top_k)  # sorted, descending
    else:
        logits, cand = logits.sort(-1, descending=True)
    probs = torch.softmax(logits, -1)
    if args.top_p < 1:
        # Drop a token when the ones before it already reach top_p (the first never).
        probs = probs.masked_fill((probs.cumsum(-1) - probs) >= args.top_p, 0.0)
    if args.min_p > 0:
        probs = probs.masked_fill(probs < args.min_p * probs[:, :1], 0.0)
    pick = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)
    return cand.gather(-1, pick)[:, 0]


def hf_backend(args: argparse.Namespace) -> Backend:
    """transformers on left-padded batches of ``--batch-size`` prompts of similar length
    (fp32 on a CPU): our own decoding loop over the model's KV cache, which drops a row
    as soon as it ends (``generate`` computes every row until the longest ends)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.chat_template is None:
        raise ValueError(f"--model {args.model}: the tokenizer has no chat template")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None:
        raise ValueError(f"--model {args.model}: the tokenizer has neither a pad nor an eos token")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":  # fp32 is the faster one on CPU for the demo's tiny verifier
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    else:  # bf16 is ~3.5x faster on CPU for a 135M model (SmolLM2)
        dtype = getattr(torch, args.dtype)
    # eager where sdpa would drop a feature vLLM computes (Gemma 2's soft-capping, sinks)
    config = AutoConfig.from_pretrained(args.model)
    kwargs = {"dtype": dtype}
    attn = attn_impl.choose(config, args.attn_implementation, device)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).to(device).eval()
    log.info("hf backend: attention %s, %s", attn_impl.loaded_implementation(model), dtype)
    eos = model.generation_config.eos_token_id
    eos = tok.eos_token_id if eos is None else eos
    eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos], device=device)

    @torch.no_grad()
    def decode(prompts: list[list[int]], seed: int) -> list[tuple[list[int], str]]:
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), pad, dtype=torch.long)
        att = torch.zeros((n, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            att[r, width - len(p) :] = 1
        ids, att = ids.to(device), att.to(device)
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device=device).manual_seed(seed)
        cache = DynamicCache()
        out = model(input_ids=ids, attention_mask=att, position_ids=pos,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        alive = torch.arange(n, device=device)
        next_pos = pos[:, -1] + 1
        new: list[list[int]] = [[] for _ in range(n)]
        finish = ["length"] * n
        for step in range(args.max_new_tokens):
            token = _sample(out.logits[:, -1].float(), args, gen)
            ended = torch.isin(token, eos_ids)
            for r, t, e in zip(alive.tolist(), token.tolist(), ended.tolist(), strict=True):
                if e:
                    finish[r] = "stop"
                else:
                    new[r].append(t)
            if step == args.max_new_tokens - 1:
                break
            keep = ~ended
            if not keep.all():
                if not keep.any():
                    break
                idx = keep.nonzero()[:, 0]
                cache.batch_select_indices(idx)
                alive, token, att, next_pos = alive[idx], token[idx], att[idx], next_pos[idx]
            att = torch.cat([att, att.new_ones((len(alive), 1))], 1)
            out = model(input_ids=token[:, None], attention_mask=att, position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True)  # fmt: skip
            next_pos = next_pos + 1
        return list(zip(new, finish, strict=True))

    def generate(batch: list[list[dict]], first_index: int = 0) -> list[tuple[str | None, str]]:
        prompts = [
            list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, **_tk(args)))
            for m in batch
        ]
        out: list[tuple[str | None, str]] = [(None, "")] * len(batch)
        order = sorted(range(len(batch)), key=lambda i: len(prompts[i]))
        for s in range(0, len(order), args.batch_size):
            idx = order[s : s + args.batch_size]
            results = decode([prompts[i] for i in idx], args.seed + first_index + idx[0])
            for i, (ids, finish) in zip(idx, results, strict=True):
                out[i] = (tok.decode(ids, skip_special_tokens=True), finish)
        return out

    return generate


def _tk(args: argparse.Namespace) -> dict:
    extra = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    return {"return_dict": False, **extra}


# --------------------------------------------------------------------------- the run
def _at(backend: Backend, first_index: int) -> Backend:
    """The backend with its seed offset fixed (the chunk's first conversation)."""
    return lambda prompts, _first=0: backend(prompts, first_index)


def settings(args: argparse.Namespace, data: Path) -> dict:
    return {
        "format": FORMAT,
        "data": str(data),
        "model": args.model,
        "served_model_name": args.served_model_name,
        "backend": args.backend,
        "endpoint": args.endpoint if args.backend == "openai" else None,
        "history": args.history,
        "chat_template_kwargs": args.chat_template_kwargs,
        "sampling": sampling_params(args),
    }


def regenerate_chunk(
    records: list[dict], first_index: int, backend: Backend, history: str
) -> list[dict]:
    """Regenerate the assistant turns of ``records`` (indices ``first_index``..). One item
    per record: ``{"index", "record", "turns", "truncated"}`` or ``{"index", "error"}``."""
    out = [copy.deepcopy(r) for r in records]
    todo = {i: assistant_turns(r) for i, r in enumerate(records)}
    errors: dict[int, str] = {}
    turns = [0] * len(records)
    truncated = [0] * len(records)
    for i, ts in todo.items():
        if ts and ts[0] == 0:
            errors[i] = "an assistant turn with no turn before it"
    # regenerated: turn w of every conversation after its regenerated turns (waves);
    # original: every turn at once, each after the original history.
    if history == "original":
        waves = [[(i, t) for i, ts in todo.items() for t in ts]]
    else:
        depth = max((len(ts) for ts in todo.values()), default=0)
        waves = [[(i, ts[w]) for i, ts in todo.items() if len(ts) > w] for w in range(depth)]
    for wave in waves:
        wave = [(i, t) for i, t in wave if i not in errors]
        if not wave:
            continue
        src = records if history == "original" else out
        prompts = [[_prompt_turn(x) for x in src[i][turns_key(records[i])][:t]] for i, t in wave]
        for (i, t), (text, finish) in zip(wave, backend(prompts, first_index), strict=True):
            if text is None:
                errors[i] = finish
                continue
            turn = out[i][turns_key(records[i])][t]
            for key in ("reasoning_content", "thinking", "tool_calls"):
                turn.pop(key, None)
            turn["content"] = text
            turns[i] += 1
            truncated[i] += finish == "length"
    return [
        {"index": first_index + i, "error": errors[i]}
        if i in errors
        else {
            "index": first_index + i,
            "record": out[i],
            "turns": turns[i],
            "truncated": truncated[i],
        }
        for i in range(len(records))
    ]


def _differing_settings(recorded: dict, expected: dict) -> list[str]:
    """The settings in which two runs' answers differ. The endpoint is where the model
    was, not what it is: a restarted server at another address continues the same run."""
    keys = set(recorded) | set(expected)
    return sorted(k for k in keys if k != "endpoint" and recorded.get(k) != expected.get(k))


def _read_partial(path: Path, expected: dict) -> dict[int, dict]:
    """Done conversations of an earlier run: {index: {"record" or "error"}}."""
    done: dict[int, dict] = {}
    with path.open(encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    if not lines or not lines[0]:
        return done
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        raise ValueError(f"{path}: the first line is not this tool's settings") from None
    diff = _differing_settings(header, expected)
    if diff:
        raise ValueError(
            f"{path} was written with other settings ({', '.join(diff)}): rerun with the "
            "same flags, or remove it to start over"
        )
    for line in lines[1:]:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: that conversation is redone
        done[int(item["index"])] = item
    return done


def run(args: argparse.Namespace, backend: Backend | None = None) -> dict:
    data, output = Path(args.data), Path(args.output)
    sidecar = output.with_name(output.name + SIDECAR_SUFFIX)
    partial = output.with_name(output.name + PARTIAL_SUFFIX)
    expected = settings(args, data)
    if output.exists():
        recorded = json.loads(sidecar.read_text()).get("settings") if sidecar.is_file() else None
        if isinstance(recorded, dict) and not _differing_settings(recorded, expected):
            log.info("%s is already complete (%s)", output, sidecar)
            return json.loads(sidecar.read_text())
        raise ValueError(
            f"--output {output} exists (not this run's: {sidecar} differs or is missing); "
            "choose another path"
        )
    records = read_conversations(data)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = _read_partial(partial, expected) if partial.exists() else {}
    if done:
        log.info(
            "resuming: %d of %d conversations already done (%s)", len(done), len(records), partial
        )
    backend = backend or (hf_backend(args) if args.backend == "hf" else openai_backend(args))
    todo = [i for i in range(len(records)) if i not in done]
    from tqdm import tqdm

    bar = tqdm(
        total=len(records), initial=len(done), desc="regenerate", unit="conv",
        dynamic_ncols=True, mininterval=1.0,
    )  # fmt: skip
    mode = "a" if partial.exists() else "w"
    with partial.open(mode, encoding="utf-8") as fh:
        if mode == "w":
            fh.write(json.dumps(expected) + "\n")
        elif not partial.read_text(encoding="utf-8").endswith("\n"):
            fh.write("\n")  # after a line cut by a kill: start a fresh one
        for s in range(0, len(todo), args.chunk_size):
            idx = todo[s : s + args.chunk_size]
            # Not contiguous after a resume: each item takes its own index back.
            items = regenerate_chunk(
                [records[i] for i in idx], 0, _at(backend, idx[0]), args.history
            )
            for i, item in zip(idx, items, strict=True):
                item["index"] = i
                done[i] = item
                fh.write(json.dumps(item, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            bar.update(len(idx))
    bar.close()
    totals = {k: sum(it.get(k, 0) for it in done.values()) for k in ("turns", "truncated")}
    failed = {str(i): records[i].get("id", i) for i, it in sorted(done.items()) if "error" in it}
    errors = {str(i): it["error"] for i, it in sorted(done.items()) if "error" in it}
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as fh:
        for i in range(len(records)):
            if "record" in done[i]:
                fh.write(json.dumps(done[i]["record"], ensure_ascii=False) + "\n")
    summary = {
        "settings": expected,
        "conversations_in": len(records),
        "conversations_out": len(records) - len(failed),
        "assistant_turns_regenerated": totals["turns"],
        "assistant_turns_cut_at_max_new_tokens": totals["truncated"],
        "failed": {i: {"id": failed[i], "error": errors[i]} for i in failed},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stmp = sidecar.with_name(f".{sidecar.name}.tmp-{os.getpid()}")
    stmp.write_text(json.dumps(summary, indent=2) + "\n")
    commit_file(stmp, sidecar)
    commit_file(tmp, output)
    partial.unlink()
    if failed:
        log.warning("%d conversations failed and were left out (%s)", len(failed), sidecar)
    log.info(
        "%s: %d conversations, %d assistant turns regenerated (%d cut at --max-new-tokens)",
        output, summary["conversations_out"], totals["turns"], totals["truncated"],
    )  # fmt: skip
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m launch.regenerate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--data", required=True, help="conversations JSONL file")
    ap.add_argument("--output", required=True, help="regenerated conversations JSONL file")
    ap.add_argument("--model", required=True, help="the verifier (HF folder or repo id)")
    ap.add_argument("--backend", choices=("openai", "hf"), default="openai")
    ap.add_argument("--endpoint", default="http://127.0.0.1:8000/v1",
                    help="openai: the server's /v1 URL")  # fmt: skip
    ap.add_argument("--served-model-name", default=None,
                    help="openai: the model id the server serves (default: --model)")  # fmt: skip
    ap.add_argument("--history", choices=("regenerated", "original"), default="regenerated",
                    help="what a later assistant turn is generated after: the regenerated "
                    "earlier answers (DeepSpec) or the original ones")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=20, help="0: off")
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-template-kwargs", default=None,
                    help='JSON, e.g. \'{"enable_thinking": false}\'')  # fmt: skip
    ap.add_argument("--requests-in-flight", type=int, default=64, help="openai")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="openai, seconds")
    ap.add_argument("--max-retries", type=int, default=3, help="openai: HTTP retries")
    ap.add_argument("--batch-size", type=int, default=64, help="hf: prompts per generate call")
    ap.add_argument("--device", default=None, help="hf: torch device (default cuda if any)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="hf: compute dtype (auto: float32 on CPU, bfloat16 on GPUs)")  # fmt: skip
    attn_impl.add_flag(ap)  # hf
    ap.add_argument("--threads", type=int, default=None,
                    help="hf: torch CPU threads (default torch's; 1 is much faster on a "
                    "loaded machine, where waiting threads spin)")  # fmt: skip
    ap.add_argument("--chunk-size", type=int, default=256,
                    help="conversations per resumable chunk")  # fmt: skip
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "requests_in_flight", "batch_size", "chunk_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= args.min_p < 1:
        ap.error("sampling: --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0, 0 <= --min-p < 1")
    if args.chat_template_kwargs:
        try:
            if not isinstance(json.loads(args.chat_template_kwargs), dict):
                raise ValueError
        except ValueError:
            ap.error("--chat-template-kwargs must be a JSON object")
    return args


def _main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        log.warning(
            "interrupted; finished chunks are kept in the .partial file, run again to resume"
        )
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from dspark_jax.cli import guarded

    return guarded(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
