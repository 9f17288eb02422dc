"""Served-equivalent acceptance: what a greedy engine's counters report (numpy, host side).

An engine does not draft at every anchor of a text. Speculative decoding with greedy
verification (temperature 0) walks the verifier's own greedy continuation of a prompt:

1. the prompt's pass (prefill) samples the first response token, at position ``s``;
2. the drafter drafts ``N`` tokens from the last verified token ``a`` (the block
   ``[x_a, mask...]``, context strictly before ``a``); the verifier accepts the longest
   prefix equal to its own greedy tokens, ``n`` of them, and samples one more (the bonus);
3. the next block starts at the bonus token, ``a + n + 1``, until the response ends.

When the dataset's response *is* the verifier's greedy continuation (served text, or
``launch.regenerate`` greedy), the verifier's greedy token at every position is the
text's token, so step 2 accepts draft position ``j`` (token ``a + 1 + j``) iff the
drafter's free-running greedy token equals the text's, and the walk above equals, token
for token, what a greedy engine does: no engine needed. The drafter's token is compared
with the text in the *verifier's* vocabulary (a reduced draft vocabulary cannot draft a
token outside it, and the engine rejects it there).

Counters, as vLLM's and llama.cpp's (a step is a verifier pass with a non-empty draft):
``drafts`` steps, ``draft_tokens`` drafted tokens, ``accepted`` accepted ones (the bonus
not counted), ``accepted_per_pos[j]`` steps that accepted position j;
``acceptance_length = 1 + accepted / drafts`` (what the engines log as mean acceptance
length) and ``tokens_per_pass = generated / (drafts + requests)`` (every generated token
over every verifier pass, the prefill's included).

The end of a response (``EngineRules``; file:line in docs/engines.md):

* llama.cpp runs sliding-window draft layers bidirectional inside the block
  (:func:`as_served`), cuts each draft to ``min(N, remaining - 1)`` tokens under a token budget (no
  draft with one token left: a plain decode step, not counted), and an end-of-sequence
  token matched *before* the draft's last slot ends the step as its bonus, not as an
  accepted token. Both are exact from the text, so its walk is exact.
* vLLM drafts ``N`` tokens whatever remains and counts what the verifier accepts past
  the response's end (after its end-of-sequence token or beyond the budget) before it
  truncates the output. Those tokens are not in a dataset's text: there the walk counts
  them as rejected, a lower bound, off by at most ``N`` accepted tokens per response;
  given the verifier's greedy continuation past each end (``past_end``, what
  :mod:`dspark_jax.eval.predict` computes for an engine's responses), it counts them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dspark_jax.eval import acceptance


def accepted_counts(
    draft_ids: np.ndarray,
    anchors: np.ndarray,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    document_ids: np.ndarray,
) -> np.ndarray:
    """Draft tokens a greedy verifier accepts at each anchor of one row: [A] int.

    ``draft_ids`` [A, N]: the drafter's free-running greedy tokens for draft positions
    0..N-1 (verifier ids; position j drafts the token at ``anchor + 1 + j``). Position j
    counts iff it and every earlier position equal the row's token there, inside the
    anchor's document and supervised (``loss_mask``: the response being walked).
    """
    draft_ids = np.asarray(draft_ids)
    anchors = np.asarray(anchors, np.int64)
    num, n = draft_ids.shape
    seq = input_ids.shape[0]
    pos = anchors[:, None] + 1 + np.arange(n)[None, :]  # [A, N]
    inside = pos < seq
    at = np.minimum(pos, seq - 1)
    ok = (
        inside
        & (draft_ids == input_ids[at])
        & (loss_mask[at] > 0)
        & (document_ids[at] == document_ids[anchors][:, None])
    )
    return np.cumprod(ok, axis=1).sum(axis=1).astype(np.int64)


def response_spans(loss_mask: np.ndarray, document_ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``(s, e)`` (inclusive) of supervised positions within one document:
    each is one response an engine generates (its first token from the prefill)."""
    on = (np.asarray(loss_mask) > 0) & (np.asarray(document_ids) >= 0)
    spans, s = [], None
    for t in range(on.shape[0]):
        if on[t] and (s is None or document_ids[t] != document_ids[t - 1]):
            if s is not None:
                spans.append((s, t - 1))
            s = t
        elif not on[t] and s is not None:
            spans.append((s, t - 1))
            s = None
    if s is not None:
        spans.append((s, on.shape[0] - 1))
    return spans


@dataclasses.dataclass(frozen=True)
class EngineRules:
    """How an engine drafts and counts at the end of a response (module docstring)."""

    name: str
    cap_to_budget: bool  # drafts cut to the budget's remaining tokens - 1
    eos_is_bonus: bool  # an end-of-sequence token matched before the last slot: the bonus
    sliding_non_causal: bool  # sliding-window draft layers bidirectional inside the block
    counts_past_end: bool  # draft tokens accepted past the response's end are counted


ENGINES = {
    "llama.cpp": EngineRules(
        "llama.cpp",
        cap_to_budget=True,
        eos_is_bonus=True,
        sliding_non_causal=True,
        counts_past_end=False,
    ),  # fmt: skip
    "vllm": EngineRules(
        "vllm",
        cap_to_budget=False,
        eos_is_bonus=False,
        sliding_non_causal=False,
        counts_past_end=True,
    ),  # fmt: skip
}


def as_served(cfg, rules: EngineRules):
    """The drafter config as ``rules``' engine runs it: llama.cpp runs every draft layer
    non-causal (``llama_set_causal_attn(ctx_dft, false)``), so a sliding-window layer
    trained causal inside its block is served bidirectional there (its window is also
    measured from each query, not from the anchor: the same while the window covers the
    context). Returns (config, what changed or None)."""
    sliding = any(cfg.layer_sliding_window(i) is not None for i in range(cfg.num_hidden_layers))
    if rules.sliding_non_causal and sliding and not cfg.sliding_window_non_causal:
        why = (
            f"{rules.name} runs the sliding-window draft layers non-causal inside the block "
            "(trained causal): the walk drafts as it does"
        )
        return cfg.replace(sliding_window_non_causal=True), why
    return cfg, None


def walk(
    span: tuple[int, int],
    accepted_at: dict[int, int] | np.ndarray,
    num_draft: int,
    *,
    ends_with_eos: bool = True,
    max_new_tokens: int | None = None,
    rules: EngineRules = ENGINES["llama.cpp"],
    beyond: int = 0,
) -> list[tuple[int, int, int]]:
    """The greedy engine's verifier passes after the prefill over one response ``(s, e)``:
    ``[(anchor, n, k)]``, ``n`` of ``k`` drafted tokens accepted (``k == 0``: a plain
    decode step, no draft).

    ``accepted_at[a]``: draft tokens matching the text at anchor ``a``
    (:func:`accepted_counts`; they never pass ``e``, the response's last token). The first
    anchor is ``s`` (the prefill's token); each step moves to its bonus token,
    ``a + n + 1``; a step whose accepted tokens reach ``e`` ends the response.
    ``max_new_tokens``: the request's budget (the response has at most that many tokens).
    ``beyond``: tokens of the verifier's greedy continuation known past ``e``
    (``accepted_at`` counts matches through them): an engine that counts past the end
    (vLLM) counts those its last step accepts, though they are never served.
    """
    s, e = span
    past = beyond if rules.counts_past_end else 0
    steps, a = [], s
    while a < e:
        k = num_draft
        if rules.cap_to_budget and max_new_tokens is not None:
            k = min(k, max_new_tokens - (a - s + 1) - 1)
        if k <= 0:  # no draft: a plain decode step
            steps.append((a, 0, 0))
            a += 1
            continue
        n = min(int(accepted_at[a]), k, e - a + past)
        if rules.eos_is_bonus and ends_with_eos and a + n == e and n < k:
            n -= 1  # the matched end-of-sequence token is the step's bonus
        steps.append((a, n, k))
        a += n + 1
    return steps


@dataclasses.dataclass
class ServedSteps:
    """Every verifier pass after a prefill in a dataset's walk (host arrays, one entry per
    pass; ``drafted == 0``: no draft) and the responses walked: ``generated[r]`` tokens
    of response ``r``."""

    accepted: np.ndarray  # [steps] int
    drafted: np.ndarray  # [steps] int: draft tokens of the step
    context_pos: np.ndarray  # [steps] the anchor's position in its document
    request: np.ndarray  # [steps] response index
    generated: np.ndarray  # [responses] int
    margin: np.ndarray | None = None  # [steps] the drafter's smallest deciding top-2 margin

    @classmethod
    def empty(cls) -> ServedSteps:
        z = np.zeros(0, np.int64)
        return cls(z, z, z, z, z, np.zeros(0))

    @classmethod
    def concat(cls, parts: Sequence[ServedSteps]) -> ServedSteps:
        out, offset = [], 0
        for p in parts:
            out.append(dataclasses.replace(p, request=p.request + offset))
            offset += p.generated.shape[0]
        if not out:
            return cls.empty()
        fields = [f.name for f in dataclasses.fields(cls)]
        if any(p.margin is None for p in out):
            out = [dataclasses.replace(p, margin=np.full(p.accepted.shape, np.inf)) for p in out]
        return cls(*(np.concatenate([getattr(p, f) for p in out]) for f in fields))


def row_steps(
    draft_ids: np.ndarray,
    anchors: np.ndarray,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    position_ids: np.ndarray,
    document_ids: np.ndarray,
    *,
    eos_ids: Sequence[int] = (),
    max_new_tokens: int | None = None,
    rules: EngineRules = ENGINES["llama.cpp"],
    margins: np.ndarray | None = None,
    past_end: int = 0,
) -> ServedSteps:
    """The walk over every response of one row. ``anchors`` must hold every supervised
    position of the row (each response's anchors), ``draft_ids`` their drafts [A, N].

    A response whose last token is in ``eos_ids`` ended on it; one longer than
    ``max_new_tokens`` is cut to it (the engine stops there; a served response of exactly
    the budget gets an end-of-sequence token from the chat template, which this drops).
    ``margins`` [A, N]: the drafter's top-2 logit margin at each draft position; each step
    records the smallest over the positions that decided it (its accepted ones and the
    first rejected): an engine's rounding can change the step only there.
    ``past_end``: the last ``past_end`` supervised tokens of every response are the
    verifier's greedy continuation past its end (:func:`walk`'s ``beyond``), not served.
    """
    num_draft = draft_ids.shape[1]
    n_at = np.zeros(input_ids.shape[0], np.int64)
    n_at[anchors] = accepted_counts(draft_ids, anchors, input_ids, loss_mask, document_ids)
    have = np.zeros(input_ids.shape[0], bool)
    have[anchors] = True
    eos = np.asarray(list(eos_ids), np.int64)
    margin_at = np.full((input_ids.shape[0], num_draft), np.inf)
    if margins is not None:
        margin_at[anchors] = margins
    acc, drafted, ctx, req, gen, tie = [], [], [], [], [], []
    for r, (s, e) in enumerate(response_spans(loss_mask, document_ids)):
        e -= past_end
        if max_new_tokens is not None and e - s + 1 > max_new_tokens:
            e, ends = s + max_new_tokens - 1, False
        else:
            ends = bool(np.isin(input_ids[e], eos))
        gen.append(e - s + 1)
        steps = walk(
            (s, e), n_at, num_draft, ends_with_eos=ends, max_new_tokens=max_new_tokens,
            rules=rules, beyond=past_end,
        )  # fmt: skip
        for a, n, k in steps:
            if not have[a]:
                raise ValueError(f"served walk: no draft at anchor {a} (response {s}..{e})")
            acc.append(n)
            drafted.append(k)
            tie.append(float(margin_at[a, : min(n + 1, k)].min()) if k else np.inf)
            ctx.append(int(position_ids[a]))
            req.append(r)
    as_int = lambda v: np.asarray(v, np.int64)  # noqa: E731
    return ServedSteps(
        as_int(acc), as_int(drafted), as_int(ctx), as_int(req), as_int(gen),
        np.asarray(tie, np.float64),
    )  # fmt: skip


def counters(accepted: np.ndarray, drafted: np.ndarray, num_draft: int) -> dict:
    """The engine's counters over the steps with a draft (``accepted`` of ``drafted``
    tokens each; steps without one, ``drafted == 0``, count nowhere)."""
    drafted = np.asarray(drafted, np.int64)
    accepted = np.asarray(accepted, np.int64)[drafted > 0]
    drafts = int(accepted.shape[0])
    per_pos = [int((accepted > j).sum()) for j in range(num_draft)]
    total = int(accepted.sum())
    return {
        "drafts": drafts,
        "draft_tokens": int(np.sum(drafted)),
        "accepted": total,
        "accepted_per_pos": per_pos,
        "acceptance_length": 1.0 + total / drafts if drafts else None,
        "cumulative": [v / drafts if drafts else None for v in per_pos],
    }


def summary(
    steps: ServedSteps,
    num_draft: int,
    context_edges: Sequence[int] = acceptance.DEFAULT_CONTEXT_EDGES,
    longest: int | None = None,
) -> dict:
    """The served-equivalent figures of one dataset (JSON-able)."""
    out = counters(steps.accepted, steps.drafted, num_draft)
    responses = int(steps.generated.shape[0])
    generated = int(steps.generated.sum())
    passes = int(steps.accepted.shape[0]) + responses  # the prefill's and every step's
    out.update(
        responses=responses,
        generated=generated,
        passes=passes,
        tokens_per_pass=generated / passes if passes else None,
        by_context=[],
    )
    for lo, hi, sel in acceptance.context_buckets(steps.context_pos, context_edges, longest):
        c = counters(steps.accepted[sel], steps.drafted[sel], num_draft)
        out["by_context"].append(
            {
                "lo": lo,
                "hi": hi,
                "label": acceptance.bucket_label(lo, hi),
                "drafts": c["drafts"],
                "acceptance_length": c["acceptance_length"],
                "cumulative": c["cumulative"],
            }
        )
    return out
