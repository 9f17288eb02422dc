"""The served-equivalent walk (dspark_jax/eval/served.py): its rules on hand-made cases,
and against a true speculative-decoding loop (the demo verifier in JAX + a trained
drafter) that must be lossless and count exactly what the walk predicts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.eval import served

LLAMA, VLLM = served.ENGINES["llama.cpp"], served.ENGINES["vllm"]


# ------------------------------------------------------------------ the rules
def test_accepted_counts_stop_at_mismatch_mask_and_document():
    ids = np.array([5, 6, 7, 8, 9, 10, 11, 12])
    mask = np.array([0, 1, 1, 1, 1, 0, 1, 1])
    doc = np.array([0, 0, 0, 0, 0, 0, 1, 1])
    anchors = np.array([1, 2, 4, 5])
    drafts = np.array([
        [7, 8, 0],  # tokens 7, 8 match, then a mismatch: 2
        [8, 9, 10],  # 8, 9 match; 10 is unsupervised (loss_mask 0): 2
        [10, 11, 12],  # 10 matches the text but is unsupervised: 0
        [11, 12, 0],  # 11 is in the next document: 0
    ])  # fmt: skip
    got = served.accepted_counts(drafts, anchors, ids, mask, doc)
    np.testing.assert_array_equal(got, [2, 2, 0, 0])


def test_response_spans_split_turns_and_documents():
    mask = np.array([0, 1, 1, 0, 1, 1, 1, 0])
    doc = np.array([0, 0, 0, 0, 0, 1, 1, -1])
    assert served.response_spans(mask, doc) == [(1, 2), (4, 4), (5, 6)]


def test_walk_moves_to_the_bonus_token():
    n_at = np.full(40, 3)
    n_at[14] = 0
    # s=10: 3 accepted -> bonus at 14; 0 accepted -> 15; 3 -> 19; e=21: 2 reach the end.
    steps = served.walk((10, 21), n_at, 4, ends_with_eos=False, rules=VLLM)
    assert steps == [(10, 3, 4), (14, 0, 4), (15, 3, 4), (19, 2, 4)]


def test_llamacpp_end_of_sequence_matched_before_the_last_slot_is_the_bonus():
    n_at = np.full(40, 4)
    # Anchors 10, 15; EOS at 17 = draft position 1 of 4: llama.cpp accepts 1, EOS is the bonus.
    assert served.walk((10, 17), n_at, 4, rules=LLAMA) == [(10, 4, 4), (15, 1, 4)]
    # vLLM counts the EOS as accepted.
    assert served.walk((10, 17), n_at, 4, rules=VLLM)[-1] == (15, 2, 4)
    # EOS in the draft's last slot: accepted by both (the bonus after it is dropped).
    assert served.walk((10, 19), n_at, 4, rules=LLAMA)[-1] == (15, 4, 4)
    # A response cut by the budget, not an EOS: every matched token is accepted.
    assert served.walk((10, 17), n_at, 4, ends_with_eos=False, rules=LLAMA)[-1] == (15, 2, 4)


def test_vllm_counts_what_it_accepts_past_the_end():
    n_at = np.full(40, 4)
    # Two continuation tokens known past e=17: vLLM's last step accepts them too (4, not 2);
    # llama.cpp never drafts past the end (the draft is cut) and the EOS is its bonus there.
    assert served.walk((10, 17), n_at, 4, rules=VLLM, beyond=2)[-1] == (15, 4, 4)
    assert served.walk((10, 17), n_at, 4, rules=LLAMA, beyond=2)[-1] == (15, 1, 4)
    n_at[15] = 3  # the continuation matched through one token: 3 accepted
    assert served.walk((10, 17), n_at, 4, rules=VLLM, beyond=2)[-1] == (15, 3, 4)


def test_llamacpp_cuts_drafts_to_the_budget():
    n_at = np.full(40, 8)
    # Budget 8 tokens (s=0..e=7): after the prefill's token, 7 remain: a draft of 6, all
    # accepted, bonus at 7 = the last token: the response ends, no plain step.
    assert served.walk((0, 7), n_at, 8, ends_with_eos=False, max_new_tokens=8, rules=LLAMA) == [
        (0, 6, 6)
    ]
    # One accepted per step: 6 remaining -> draft 5 ... until one remains: a plain step.
    one = np.ones(40, int)
    steps = served.walk((0, 7), one, 8, ends_with_eos=False, max_new_tokens=8, rules=LLAMA)
    assert steps == [(0, 1, 6), (2, 1, 4), (4, 1, 2), (6, 0, 0)]
    c = served.counters([s[1] for s in steps], [s[2] for s in steps], 8)
    assert (c["drafts"], c["draft_tokens"], c["accepted"]) == (3, 12, 3)  # the plain step: none


def test_summary_counts_passes_and_tokens():
    steps = served.ServedSteps(
        accepted=np.array([3, 0, 2]), drafted=np.array([4, 4, 4]),
        context_pos=np.array([5, 9, 10]), request=np.array([0, 0, 0]), generated=np.array([8]),
    )  # fmt: skip
    out = served.summary(steps, 4, context_edges=(0, 8))
    assert out["acceptance_length"] == pytest.approx(1 + 5 / 3)
    assert out["accepted_per_pos"] == [2, 2, 1, 0]
    assert out["passes"] == 4 and out["tokens_per_pass"] == pytest.approx(8 / 4)
    assert [b["drafts"] for b in out["by_context"]] == [1, 2]


# ------------------------------------------------------------------ a true loop
MAX_NEW = 40
PROMPTS = 3


@pytest.fixture(scope="module")
def predictor(served_drafter):
    """The trained drafter with the demo verifier in the step (fp32), llama.cpp's rules."""
    from dspark_jax.eval.predict import ResponsePredictor
    from tests.served.fixtures import VERIFIER

    return ResponsePredictor(served_drafter, VERIFIER, seq_len=256, max_new_tokens=MAX_NEW)


class Loop:
    """Greedy speculative decoding, as llama.cpp's server does it (docs/engines.md):
    the verifier (JAX, whole-row forwards) and the drafter (the evaluator's own jitted
    statistics at one anchor) on rows of the evaluator's shape."""

    def __init__(self, predictor):
        self.pr, self.ev = predictor, predictor.ev
        self.eos = set(self.ev.settings.eos_ids)
        self.greedy_next = predictor.greedy_next

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """The drafter's k free-running greedy tokens from the last token (the anchor)."""
        ev = self.ev
        size = ev.settings.anchors_per_call
        anchors = np.zeros(size, np.int32)
        anchors[0] = len(tokens) - 1
        valid = np.arange(size) == 0
        out = ev._stats(ev.params, ev.frozen, self.pr.filled(tokens), jnp.asarray(anchors),
                        jnp.asarray(valid), jax.random.key(0), ev.d2t)  # fmt: skip
        start = 0 if ev.cfg.sample_from_anchor else 1
        return [int(t) for t in np.asarray(out["draft_fr"])[0, start : start + k]]

    def plain(self, prompt: list[int]) -> list[int]:
        tokens = list(prompt)
        while len(tokens) - len(prompt) < MAX_NEW:
            tokens.append(int(self.greedy_next(tokens)[-1]))
            if tokens[-1] in self.eos:
                break
        return tokens[len(prompt) :]

    def speculative(self, prompt: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
        n_draft = self.ev.num_draft
        tokens = list(prompt) + [int(self.greedy_next(prompt)[-1])]  # the prefill's token
        steps = []
        while tokens[-1] not in self.eos and len(tokens) - len(prompt) < MAX_NEW:
            a = len(tokens) - 1
            k = min(n_draft, MAX_NEW - (len(tokens) - len(prompt)) - 1)
            if k <= 0:
                tokens.append(int(self.greedy_next(tokens)[-1]))
                steps.append((a, 0, 0))
                continue
            drafts = self.draft(tokens, k)
            target = self.greedy_next(tokens + drafts)[a:]  # the verifier at a .. a+k
            n = 0
            while n < k and drafts[n] == target[n]:
                if target[n] in self.eos and n + 1 < k:
                    break  # llama.cpp: a matched EOS before the last slot is the bonus
                n += 1
            steps.append((a, n, k))
            for t in [*drafts[:n], int(target[n])]:
                tokens.append(t)
                if t in self.eos or len(tokens) - len(prompt) == MAX_NEW:
                    break
        return tokens[len(prompt) :], steps


@pytest.mark.served  # shares the trained drafter with tests/served (CI runs them together)
def test_speculative_loop_is_lossless_and_equals_the_walk(predictor):
    from tests.served.fixtures import heldout_prompts

    loop = Loop(predictor)
    total = {"drafts": 0, "accepted": 0}
    for prompt in heldout_prompts(PROMPTS):
        plain = loop.plain(prompt)
        text, steps = loop.speculative(prompt)
        assert text == plain  # (a) lossless

        # (b) the evaluator's walk over that text drafts at the same anchors and accepts
        # the same tokens, step for step; the text is the verifier's argmax throughout.
        pred = predictor.predict(prompt, text)
        got = list(zip(pred.steps.context_pos.tolist(), pred.steps.accepted.tolist(),
                       pred.steps.drafted.tolist()))  # fmt: skip
        assert got == steps
        assert pred.steps.generated.tolist() == [len(text)]
        assert pred.mismatches == [] and pred.min_margin >= 0
        total["drafts"] += sum(1 for s in steps if s[2])
        total["accepted"] += sum(s[1] for s in steps)
    # The drafter is trained (~0.8 tokens accepted per draft here, up to all of a draft):
    # a walk at the wrong anchors could not agree by chance.
    assert total["accepted"] / total["drafts"] > 0.5, total
