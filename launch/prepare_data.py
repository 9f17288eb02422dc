"""Prepare training rows for a DSpark drafter (speculators ``prepare-data`` semantics).

Input: JSON/JSONL files (or folders of them) holding either conversations
(``conversations`` or ``messages``: a list of turns with ``role``/``content``, or
ShareGPT ``from``/``value``; roles system/user/assistant/tool; an optional
per-row ``tools`` column) or pre-tokenised rows (``input_ids`` + ``loss_mask``).

Output (docs/formats.md, "Prepared dataset"): a HuggingFace ``Dataset.save_to_disk`` folder with
columns ``input_ids`` (int list: int32 on disk, exactly as speculators' prepare-data
writes it through ``datasets``), ``loss_mask`` (int64 0/1 list, 1 = assistant
token) and ``seq_len`` (int64), in torch format (both lists read back as int64
tensors), plus
token counts over supervised positions: ``token_freq.pt`` (speculators' dict
``{token_id: count}``) and ``token_counts.npy`` (int64 ``[vocab]``, readable
without torch), and with ``--draft-vocab-size Vd`` the maps ``d2t-<Vd>.npy`` /
``t2d-<Vd>.npy``.

One row per assistant turn, with only that turn supervised: for assistant turn
``j`` the conversation ``conv[:j+1]`` is rendered by the tokenizer's chat template,
and the boundary is where that render extends the render of ``conv[:j]`` with the
generation prompt (falling back to their common prefix when the generation
prompt diverges, e.g. a pre-filled ``<think>``, if the history renders agree), as
the reference does through vLLM's ``/v1/chat/completions/render`` endpoint.
By default the template is rendered locally with the model's tokenizer; pass
``--render-endpoint http://host:8000`` to render through a vLLM server instead.

Row order follows the reference exactly: each input is shuffled with ``--seed``
(and cut to ``3 * --max-samples``), rows are built in that order, all inputs are
concatenated, shuffled again with ``--seed`` and cut to ``--max-samples``.

    python -m launch.prepare_data --model configs/demo/verifier \\
        --data configs/demo/conversations.jsonl --output runs/demo/data \\
        --seq-length 1024 --minimum-valid-tokens 16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("launch.prepare_data")

OVERWRITE_ALLOWED = {"dataset_info.json", "state.json", "token_freq.pt", "token_counts.npy"}

RenderFn = Callable[[list[dict], bool, "list[dict] | None"], list[int]]


class BoundaryUnstableError(ValueError):
    """The chat template is not prefix-stable at an assistant turn boundary."""


# --------------------------------------------------------------------------------------
# conversations -> rows (the reference algorithm, render function injected)
# --------------------------------------------------------------------------------------


def normalize_conversation(conv: list[dict], warned: set[str] | None = None) -> list[dict]:
    """Standard ``role``/``content`` turns (speculators' ``_normalize_conversation``)."""
    warned = set() if warned is None else warned
    out = []
    for turn in conv:
        role = turn.get("from", turn.get("role", ""))
        content = turn.get("value") or turn.get("content") or ""
        if role in ("human", "user"):
            role = "user"
        elif role in ("gpt", "assistant"):
            role = "assistant"
        elif role in ("system", "tool"):
            pass
        else:
            if role not in warned:
                warned.add(role)
                log.warning("Mapping unknown role %r -> 'assistant'", role)
            role = "assistant"
        norm = {"role": role, "content": content}
        if turn.get("tool_calls"):
            norm["tool_calls"] = turn["tool_calls"]
        if turn.get("tool_call_id"):
            norm["tool_call_id"] = turn["tool_call_id"]
        thinking = turn.get("thinking") or turn.get("reasoning_content")
        if thinking:
            norm["thinking"] = thinking
            norm["reasoning_content"] = thinking
        out.append(norm)
    return out


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def boundary_rows(
    conv: list[dict],
    render: RenderFn,
    max_length: int,
    tools: list[dict] | None = None,
) -> list[dict]:
    """One ``{"input_ids", "loss_mask"}`` row per assistant turn (not the first turn).

    ``render(conv_prefix, add_generation_prompt, tools)`` returns token ids, cut to
    ``max_length`` on the right. A turn whose context alone fills ``max_length`` is
    skipped (a later turn may fit again if the template drops old reasoning).
    """
    rows = []
    for j, turn in enumerate(conv):
        if turn["role"] != "assistant" or j == 0:
            continue
        prompt_ids = render(conv[:j], True, tools)
        if len(prompt_ids) >= max_length:
            continue
        full_ids = render(conv[: j + 1], False, tools)
        if full_ids[: len(prompt_ids)] == prompt_ids:
            boundary = len(prompt_ids)
        else:
            boundary = _common_prefix_len(prompt_ids, full_ids)
            hist_ids = render(conv[:j], False, tools)
            if full_ids[: len(hist_ids)] != hist_ids or boundary < len(hist_ids):
                raise BoundaryUnstableError(
                    f"prompt and full renders diverge inside history at assistant turn {j}; "
                    "cannot derive a boundary loss mask"
                )
        rows.append(
            {
                "input_ids": list(full_ids),
                "loss_mask": [0] * boundary + [1] * (len(full_ids) - boundary),
            }
        )
    return rows


def clip_and_filter(
    input_ids: Sequence[int],
    loss_mask: Sequence[int],
    max_length: int,
    minimum_valid_tokens: int | None,
) -> tuple[str, list[int], list[int]]:
    """Returns (status, ids, mask); status is kept / unsupervised / filtered."""
    ids, mask = list(input_ids[:max_length]), list(loss_mask[:max_length])
    n_valid = sum(mask)
    if n_valid == 0:
        return "unsupervised", ids, mask
    if minimum_valid_tokens is not None and n_valid < minimum_valid_tokens:
        return "filtered", ids, mask
    return "kept", ids, mask


def _parse_tools(tools, idx: int) -> list | None:
    if not tools:
        return None
    if isinstance(tools, list):
        return tools
    if isinstance(tools, str):
        try:
            return json.loads(tools)
        except json.JSONDecodeError as e:
            log.warning("Invalid JSON in tools column for conversation %d: %s; no tools", idx, e)
            return None
    log.warning(
        "Non-string tools value for conversation %d (%s); no tools", idx, type(tools).__name__
    )
    return None


# --------------------------------------------------------------------------------------
# renderers
# --------------------------------------------------------------------------------------


_TOKENIZERS: dict = {}


class LocalRenderer:
    """Render with the tokenizer's chat template, tokenised as vLLM does
    (template -> text -> ``encode(add_special_tokens=False)``), cut on the right."""

    def __init__(
        self,
        model: str,
        max_length: int,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict | None = None,
    ):
        self.model, self.max_length = model, max_length
        self.trust_remote_code = trust_remote_code
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._tok = None

    @property
    def tokenizer(self):
        if self._tok is None:
            key = (self.model, self.trust_remote_code)
            if key not in _TOKENIZERS:  # once per process, also in worker processes
                from transformers import AutoTokenizer

                _TOKENIZERS[key] = AutoTokenizer.from_pretrained(
                    self.model, trust_remote_code=self.trust_remote_code
                )
            self._tok = _TOKENIZERS[key]
            if getattr(self._tok, "chat_template", None) is None:
                raise ValueError(
                    f"the tokenizer of {self.model} has no chat template; pass "
                    "pre-tokenised rows (input_ids + loss_mask) or --render-endpoint"
                )
        return self._tok

    def __getstate__(self):  # workers reload the tokenizer themselves
        return {**self.__dict__, "_tok": None}

    def __call__(self, messages, add_generation_prompt, tools=None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.chat_template_kwargs,
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids[: self.max_length])


class EndpointRenderer:
    """Render through vLLM's ``POST {endpoint}/v1/chat/completions/render``
    (the reference's path), with its retry rules: 408/429/5xx and connection
    errors are retried with exponential backoff, other 4xx are not."""

    def __init__(
        self,
        endpoint: str,
        max_length: int,
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff: float = 2.0,
    ):
        self.url = endpoint.rstrip("/") + "/v1/chat/completions/render"
        self.max_length, self.timeout = max_length, timeout
        self.max_retries, self.backoff = max_retries, backoff

    def __call__(self, messages, add_generation_prompt, tools=None) -> list[int]:
        from dspark_jax.data.online.http import HTTPStatusError, post_json, retry

        body = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "truncate_prompt_tokens": self.max_length,
            "truncation_side": "right",
        }
        if tools is not None:
            body["tools"] = tools

        def once():
            data = post_json(self.url, body, timeout=self.timeout)
            if "token_ids" not in data:
                raise HTTPStatusError(
                    200, f"render response missing 'token_ids': {data}", retriable=True
                )
            return list(data["token_ids"])

        return retry(
            once, max_retries=self.max_retries, backoff=self.backoff, describe=f"POST {self.url}"
        )


# --------------------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------------------


def _load_json(path: str, files):
    """``load_dataset("json")`` with its failures (a parse error deep in Arrow, an empty
    file's StopIteration) turned into one line naming ``path``."""
    from datasets import load_dataset

    for f in [files] if isinstance(files, str) else files:
        if Path(f).is_file() and not Path(f).read_bytes().strip():
            raise ValueError(f"--data {f}: the file is empty (expected JSON rows)")
    from dspark_jax.cli import debug_enabled

    quiet = logging.getLogger("datasets")  # it logs the parse error too: said once, below
    level = quiet.level
    if not debug_enabled():
        quiet.setLevel(logging.CRITICAL)
    try:
        return load_dataset("json", data_files=files, split="train")
    except Exception as e:  # noqa: BLE001 - datasets wraps the parser's error
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        why = " ".join(str(cause).split()) or type(cause).__name__
        raise ValueError(f"--data {path}: not readable as JSON/JSONL rows ({why})") from e
    finally:
        quiet.setLevel(level)


def load_raw_rows(path: str):
    """A ``datasets.Dataset`` from a JSON/JSONL file, a folder of them, or ``hf:<id>``."""
    from datasets import load_dataset

    if path.endswith((".json", ".jsonl")):
        ds = _load_json(path, path)
    elif Path(path).is_dir():
        files = sorted(str(p) for p in (*Path(path).rglob("*.json"), *Path(path).rglob("*.jsonl")))
        if not files:
            raise ValueError(f"No .json/.jsonl files found in directory: {path}")
        ds = _load_json(path, files)
    elif path.startswith("hf:"):
        parts = path.removeprefix("hf:").split(":")
        name, subset, split = (
            parts[0],
            (parts[1] if len(parts) == 3 else None),
            (parts[-1] if len(parts) > 1 else "train"),
        )
        ds = load_dataset(name, name=subset, split=split)
    else:
        raise ValueError(
            f"Unsupported --data {path!r}: a .json/.jsonl file, a folder of them, "
            "or hf:<dataset>[:<subset>]:<split>"
        )
    cols = set(ds.column_names)
    if not cols & {"conversations", "messages"} and not {"input_ids", "loss_mask"} <= cols:
        raise ValueError(
            f"{path}: expected a 'conversations' (or 'messages') column or "
            f"'input_ids' + 'loss_mask', found {sorted(cols)}"
        )
    return ds


def _process_chunk(args) -> tuple[list[list[int]], list[list[int]], Counter]:
    rows, render, max_length, min_valid, offset = args
    stats: Counter = Counter()
    out_ids, out_mask = [], []
    warned: set[str] = set()
    for k, row in enumerate(rows):
        idx = offset + k
        if row.get("input_ids") is not None and row.get("loss_mask") is not None:
            ids, mask = row["input_ids"], row["loss_mask"]
            if len(ids) != len(mask):
                raise ValueError(
                    f"pre-tokenised row {idx}: input_ids has {len(ids)} tokens but "
                    f"loss_mask has {len(mask)}"
                )
            candidates = [{"input_ids": ids, "loss_mask": mask}]
            stats["rows_in"] += 1
        else:
            conv = row.get("conversations") or row.get("messages")
            if not conv or not isinstance(conv, list):
                stats["empty_conversations"] += 1
                continue
            stats["conversations_in"] += 1
            try:
                candidates = boundary_rows(
                    normalize_conversation(conv, warned),
                    render,
                    max_length,
                    _parse_tools(row.get("tools"), idx),
                )
            except Exception as e:  # one bad conversation must not kill the run
                log.error("Failed to process conversation %d: %s: %s", idx, type(e).__name__, e)
                stats["failed_conversations"] += 1
                continue
            if not candidates:
                stats["conversations_without_rows"] += 1
        for cand in candidates:
            status, ids, mask = clip_and_filter(
                cand["input_ids"], cand["loss_mask"], max_length, min_valid
            )
            stats[status] += 1
            if status == "kept":
                stats["maybe_truncated"] += len(cand["input_ids"]) >= max_length
                out_ids.append([int(t) for t in ids])
                out_mask.append([int(m) for m in mask])
    return out_ids, out_mask, stats


def build_rows(
    raw,
    render: RenderFn | None,
    max_length: int,
    min_valid: int | None,
    num_workers: int,
    chunk_size: int = 256,
):
    """Rows of one input, in input order, as a ``datasets.Dataset``; plus stats."""
    import pyarrow as pa
    from datasets import Dataset

    raw = raw.with_format(None)
    cols = [
        c
        for c in ("conversations", "messages", "tools", "input_ids", "loss_mask")
        if c in raw.column_names
    ]
    pretok = {"input_ids", "loss_mask"} <= set(cols)
    if not pretok and render is None:
        raise ValueError(
            "conversations need a renderer (a tokenizer with a chat template or --render-endpoint)"
        )

    def chunks() -> Iterable:
        for start in range(0, len(raw), chunk_size):
            part = raw.select_columns(cols)[start : start + chunk_size]
            rows = [dict(zip(part, vals)) for vals in zip(*part.values())]
            yield rows, render, max_length, min_valid, start

    # The reference's rows go through datasets' ArrowWriter, which stores a column
    # named input_ids as int32 (OptimizedTypedSequence); loss_mask and seq_len int64.
    # In torch format both read back as int64 tensors.
    INPUT_IDS_TYPE = pa.int32()  # noqa: N806
    stats: Counter = Counter()
    tables = []

    def collect(res):
        ids, mask, st = res
        stats.update(st)
        if ids:
            tables.append(
                pa.table(
                    {
                        "input_ids": pa.array(ids, type=pa.list_(INPUT_IDS_TYPE)),
                        "loss_mask": pa.array(mask, type=pa.list_(pa.int64())),
                        "seq_len": pa.array([len(x) for x in ids], type=pa.int64()),
                    }
                )
            )

    if num_workers > 1 and len(raw) > chunk_size:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(num_workers) as pool:
            for res in pool.imap(_process_chunk, chunks()):
                collect(res)
    else:
        for args in chunks():
            collect(_process_chunk(args))

    if tables:
        table = pa.concat_tables(tables)
    else:
        table = pa.table(
            {
                "input_ids": pa.array([], type=pa.list_(INPUT_IDS_TYPE)),
                "loss_mask": pa.array([], type=pa.list_(pa.int64())),
                "seq_len": pa.array([], type=pa.int64()),
            }
        )
    return Dataset(table), stats


def token_counts(dataset, vocab_size: int | None) -> tuple[dict[int, int], "object"]:
    """Counts of supervised (loss_mask == 1) token ids: a dict and an int64 array."""
    import numpy as np

    counts = np.zeros(max(vocab_size or 0, 1), dtype=np.int64)
    table = dataset.with_format("arrow")
    for batch in table.iter(batch_size=1024):
        ids = np.asarray(
            batch["input_ids"].combine_chunks().flatten()
            if hasattr(batch["input_ids"], "combine_chunks")
            else batch["input_ids"].flatten()
        )
        mask = np.asarray(
            batch["loss_mask"].combine_chunks().flatten()
            if hasattr(batch["loss_mask"], "combine_chunks")
            else batch["loss_mask"].flatten()
        )
        sel = ids[mask.astype(bool)]
        if sel.size and sel.max() >= counts.size:
            counts = np.concatenate([counts, np.zeros(int(sel.max()) + 1 - counts.size, np.int64)])
        counts += np.bincount(sel, minlength=counts.size).astype(np.int64)
    nz = np.nonzero(counts)[0]
    return {int(i): int(counts[i]) for i in nz}, counts


def vocab_maps(freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int):
    """``d2t`` int64 [Vd] (offsets) and ``t2d`` bool [Vt]: the Vd most frequent
    supervised ids (ties: smaller id), padded with the smallest unused ids, sorted."""
    import numpy as np

    ranked = sorted(freq, key=lambda t: (-freq[t], t))
    chosen = ranked[:draft_vocab_size]
    if len(chosen) < draft_vocab_size:
        have = set(chosen)
        for t in range(target_vocab_size):
            if len(chosen) >= draft_vocab_size:
                break
            if t not in have:
                chosen.append(t)
    chosen.sort()
    sel = np.asarray(chosen, dtype=np.int64)
    d2t = sel - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[sel] = True
    return d2t, t2d


def draft_maps(freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int):
    """:func:`vocab_maps`, refusing a draft vocabulary larger than the verifier's."""
    check_draft_vocab_size(draft_vocab_size, target_vocab_size)
    return vocab_maps(freq, draft_vocab_size, target_vocab_size)


def check_draft_vocab_size(
    draft_vocab_size: int, vocab_size: int | None, skip_token_freq: bool = False
) -> None:
    """``--draft-vocab-size`` must fit the verifier vocabulary (checked before any write)."""
    if draft_vocab_size < 1:
        raise ValueError(f"--draft-vocab-size must be >= 1, got {draft_vocab_size}")
    if skip_token_freq:
        raise ValueError("--draft-vocab-size needs the token counts; drop --skip-token-freq")
    if vocab_size is not None and draft_vocab_size > vocab_size:
        raise ValueError(
            f"--draft-vocab-size {draft_vocab_size} exceeds the verifier vocabulary "
            f"({vocab_size} tokens)"
        )


def map_paths(out: Path, draft_vocab_size: int) -> list[Path]:
    return [out / f"d2t-{draft_vocab_size}.npy", out / f"t2d-{draft_vocab_size}.npy"]


def write_missing_maps(out: Path, draft_vocab_size: int) -> list[Path]:
    """The maps of a dataset prepared without them (a rerun that adds --draft-vocab-size),
    from its ``token_counts.npy``: the maps a first run would have written. Returns the
    files written (maps already there are left as they are)."""
    import numpy as np

    missing = [p for p in map_paths(out, draft_vocab_size) if not p.exists()]
    if not missing:
        return []
    counts_path = out / "token_counts.npy"
    if not counts_path.is_file():
        raise ValueError(
            f"{counts_path} is missing (prepared with --skip-token-freq?): the maps need the "
            "token counts; prepare again with --overwrite"
        )
    counts = np.load(counts_path)
    freq = {int(i): int(counts[i]) for i in np.nonzero(counts)[0]}
    d2t, t2d = draft_maps(freq, draft_vocab_size, counts.size)
    for path, value in zip(map_paths(out, draft_vocab_size), (d2t, t2d)):
        if path in missing:
            np.save(path, value)
    return missing


def default_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cpus or 1))


def prepare(
    model: str,
    data: list[str],
    output: str,
    seq_length: int = 8192,
    max_samples: int | None = None,
    seed: int = 0,
    num_workers: int = 1,
    minimum_valid_tokens: int | None = None,
    render_endpoint: str | None = None,
    trust_remote_code: bool = False,
    allow_empty_output: bool = False,
    token_freq_path: str | None = None,
    skip_token_freq: bool = False,
    draft_vocab_size: int | None = None,
):
    """Build and save the prepared dataset; returns ``(dataset, stats)``."""
    from datasets import concatenate_datasets

    if minimum_valid_tokens is not None and minimum_valid_tokens < 0:
        raise ValueError("--minimum-valid-tokens must be >= 0")
    render: RenderFn | None
    if render_endpoint:
        render = EndpointRenderer(render_endpoint, seq_length)
    else:
        render = LocalRenderer(model, seq_length, trust_remote_code)
    vocab_size = None
    if draft_vocab_size is not None:  # a bad size is refused before the work, not after
        vocab_size = _vocab_size(model, render, trust_remote_code)
        check_draft_vocab_size(draft_vocab_size, vocab_size, skip_token_freq)

    parts, stats = [], Counter()
    for path in data:
        raw = load_raw_rows(path).shuffle(seed=seed)
        if max_samples is not None and len(raw) > 3 * max_samples:
            raw = raw.select(range(3 * max_samples))
        log.info("%s: %d input rows", path, len(raw))
        pretok = {"input_ids", "loss_mask"} <= set(raw.column_names)
        part, st = build_rows(
            raw, None if pretok else render, seq_length, minimum_valid_tokens, num_workers
        )
        parts.append(part)
        stats.update(st)

    dataset = concatenate_datasets(parts).shuffle(seed=seed)
    if max_samples is not None and len(dataset) > max_samples:
        dataset = dataset.select(range(max_samples))
    dataset = dataset.flatten_indices()
    stats["rows_out"] = len(dataset)
    if len(dataset) == 0 and not allow_empty_output:
        raise ValueError(
            "No rows remain after preprocessing. Check the data format, the "
            "assistant turns and --minimum-valid-tokens (pass --allow-empty-output "
            "if an empty dataset is intended)."
        )
    _report(stats, minimum_valid_tokens, seq_length)

    # Counts and maps are computed before the first file is written: all or nothing.
    freq = counts = maps = None
    if not skip_token_freq:
        if vocab_size is None:
            vocab_size = _vocab_size(model, render, trust_remote_code)
        freq, counts = token_counts(dataset, vocab_size)
        if draft_vocab_size:
            maps = draft_maps(freq, draft_vocab_size, counts.size)

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))
    if counts is not None:
        import numpy as np
        import torch

        freq_path = Path(token_freq_path) if token_freq_path else out / "token_freq.pt"
        freq_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(freq, freq_path)
        np.save(out / "token_counts.npy", counts)
        if maps is not None:
            for path, value in zip(map_paths(out, draft_vocab_size), maps):
                np.save(path, value)
    return dataset, stats


def _vocab_size(model: str, render, trust_remote_code: bool) -> int | None:
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        cfg = getattr(cfg, "text_config", cfg)
        return int(cfg.vocab_size)
    except Exception:  # noqa: BLE001 - a tokenizer-only folder
        if isinstance(render, LocalRenderer):
            return len(render.tokenizer)
        return None


def _report(stats: Counter, min_valid: int | None, seq_length: int) -> None:
    log.info(
        "rows kept: %d (conversations in: %d, pre-tokenised rows in: %d)",
        stats["kept"],
        stats["conversations_in"],
        stats["rows_in"],
    )
    if stats["filtered"]:
        log.info(
            "dropped %d rows with fewer than %s supervised tokens", stats["filtered"], min_valid
        )
    if stats["unsupervised"]:
        log.warning(
            "dropped %d rows with no supervised token inside --seq-length %d",
            stats["unsupervised"],
            seq_length,
        )
    if stats["maybe_truncated"]:
        log.warning(
            "%d rows reach --seq-length %d and may be truncated",
            stats["maybe_truncated"],
            seq_length,
        )
    if stats["failed_conversations"]:
        log.warning(
            "%d conversations failed to render and were skipped (see errors above)",
            stats["failed_conversations"],
        )
    if stats["conversations_without_rows"]:
        log.warning(
            "%d conversations produced no row (no assistant turn after context, or the "
            "context alone fills --seq-length)",
            stats["conversations_without_rows"],
        )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Prepare data for DSpark drafter training (speculators prepare-data semantics)"
    )
    ap.add_argument(
        "--model",
        required=True,
        help="verifier: HF id or local folder (tokenizer and chat template)",
    )
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument(
        "--data",
        action="append",
        required=True,
        help="JSON/JSONL file, folder of them, or hf:<id>[:<subset>]:<split> (repeatable)",
    )
    ap.add_argument("--output", default="./output", help="output folder")
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-preprocessing-workers",
        type=int,
        default=None,
        help="processes rendering conversations (default min(8, CPUs))",
    )
    ap.add_argument(
        "--minimum-valid-tokens",
        type=int,
        default=None,
        help="drop rows with fewer supervised tokens",
    )
    ap.add_argument(
        "--render-endpoint",
        default=None,
        help="render through a vLLM server (base URL, no /v1) instead of locally",
    )
    ap.add_argument(
        "--token-freq-path",
        default=None,
        help="where to write token_freq.pt (default: <output>/token_freq.pt)",
    )
    ap.add_argument(
        "--skip-token-freq",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="skip the supervised token counts (default: count)",
    )
    ap.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="also write d2t-<Vd>.npy / t2d-<Vd>.npy for this draft vocab size",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an existing prepared dataset in --output first",
    )
    ap.add_argument("--allow-empty-output", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from dspark_jax.cli import guarded

    return guarded(_main, argv)


def _main(argv) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    out = Path(args.output)
    if args.draft_vocab_size is not None:  # refused before anything is written or removed
        render = None if args.render_endpoint else LocalRenderer(args.model, args.seq_length,
                                                                 args.trust_remote_code)  # fmt: skip
        vocab = _vocab_size(args.model, render, args.trust_remote_code)
        check_draft_vocab_size(args.draft_vocab_size, vocab, args.skip_token_freq)
    if out.exists():
        if list(out.glob("*.arrow")) and not args.overwrite:
            written = (
                write_missing_maps(out, args.draft_vocab_size) if args.draft_vocab_size else []
            )
            if written:
                log.info(
                    "%s already holds a prepared dataset; wrote its missing %s",
                    out,
                    ", ".join(p.name for p in written),
                )
            else:
                log.warning("%s already holds a prepared dataset; skipping (use --overwrite)", out)
            return 0
        if args.overwrite:
            freq = Path(args.token_freq_path).resolve() if args.token_freq_path else None
            unexpected = [
                p
                for p in out.iterdir()
                if not (
                    p.is_file()
                    and (
                        p.suffix == ".arrow"
                        or p.name in OVERWRITE_ALLOWED
                        or p.name.startswith(("d2t-", "t2d-"))
                        or p.resolve() == freq
                    )
                )
            ]
            if unexpected:
                raise SystemExit(
                    f"--overwrite would delete files that prepare_data did not write: "
                    f"{', '.join(map(str, unexpected))}"
                )
            shutil.rmtree(out)
    prepare(
        model=args.model,
        data=args.data,
        output=args.output,
        seq_length=args.seq_length,
        max_samples=args.max_samples,
        seed=args.seed,
        num_workers=args.num_preprocessing_workers or default_workers(),
        minimum_valid_tokens=args.minimum_valid_tokens,
        render_endpoint=args.render_endpoint,
        trust_remote_code=args.trust_remote_code,
        allow_empty_output=args.allow_empty_output,
        token_freq_path=args.token_freq_path,
        skip_token_freq=args.skip_token_freq,
        draft_vocab_size=args.draft_vocab_size,
    )
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
