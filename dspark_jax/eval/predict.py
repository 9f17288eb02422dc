"""The served-equivalent prediction for given responses (token ids), and how close to a
tie the verifier was at each of their tokens.

``bench/served_acceptance.py`` and the served tests send prompts to a real engine (greedy)
and get its responses back as token ids; :class:`ResponsePredictor` walks each response as
the engine should have (:mod:`dspark_jax.eval.served`, the in-step verifier in fp32, no
hidden-state files) and checks that the response is the verifier's greedy continuation:
at every response position, the verifier's own argmax (full vocabulary) and its top-2
logit margin. A served token other than the fp32 argmax at a margin far above the engine's
rounding is a real discrepancy (layout, rope, vocab map...), one at a near-tie is the
engine's floating point. The same holds for the drafter's argmax at each step
(``min_draft_margin``): an engine's counters can differ from the walk's at a step whose
deciding draft positions are that close to a tie.

The near-tie bound: a dot product of length K rounded in another order differs by at most
``K * u * sum_i |x_i w_i|`` (``u = 2**-24``), and ``sum_i |x_i w_i| <= |x| |w|``
(Cauchy-Schwarz). Two fp32 forwards of the same weights then differ in the gap between two
logits by about ``L * K * u * |x| (|w_a| + |w_b|)``: ``x`` the normed last hidden state at
that position, ``w_a``, ``w_b`` the two tokens' head rows, ``K`` the longest dot product of a
layer (``max(hidden, intermediate)``) and ``L`` layers each adding its rounding on the way
(a first-order estimate, not a proof: the layers' errors are taken to add, not compound).
A served token whose fp32 logit is below the argmax's by at most that is the engine's
rounding; further is a real discrepancy. An engine in bf16 or f16 rounds at ``2**-8`` or
``2**-11`` instead of ``2**-24`` (``unit_roundoff``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import DSparkConfig
from dspark_jax.eval import runner, served
from dspark_jax.model.draft import ROW_KEYS
from dspark_jax.verifier import instep
from dspark_jax.verifier.frozen import load_verifier_tensors


def document_row(tokens, n_prompt: int, seq: int, cfg: DSparkConfig) -> dict[str, np.ndarray]:
    """One document (prompt, then its response supervised) in a row of ``seq`` positions,
    zero hidden states (the in-step verifier fills them)."""
    n = len(tokens)
    if n > seq:
        raise ValueError(f"a prompt and response of {n} tokens do not fit {seq}")
    ids = np.zeros(seq, np.int32)
    ids[:n] = tokens
    mask = np.zeros(seq, np.int32)
    mask[n_prompt:n] = 1
    doc = np.where(np.arange(seq) < n, 0, -1).astype(np.int32)
    pos = np.where(doc >= 0, np.arange(seq), 0).astype(np.int32)
    h = cfg.verifier_hidden_size
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "position_ids": pos,
        "document_ids": doc,
        "hidden_states": np.zeros((seq, cfg.num_aux_layers * h), np.float32),
        "verifier_last_hidden_states": np.zeros((seq, h), np.float32),
    }


@dataclasses.dataclass
class Prediction:
    steps: served.ServedSteps  # the walk over the response
    counters: dict  # served.counters of its draft steps
    mismatches: list[dict]  # response positions whose token is not the fp32 argmax
    min_margin: float  # the smallest top-2 logit margin over the response's tokens
    min_draft_margin: float  # the drafter's smallest top-2 margin where it decided a step


class ResponsePredictor:
    """A drafter (checkpoint or speculators folder) and its verifier, in fp32."""

    def __init__(
        self,
        checkpoint: str | Path,
        verifier: str | Path,
        *,
        seq_len: int,
        step: int | str = "latest",
        engine: str = "llama.cpp",
        max_new_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        unit_roundoff: float = 2.0**-24,
    ):
        """``unit_roundoff``: the engine verifier's (fp32 by default; the near-tie bound)."""
        verifier = Path(verifier)
        drafter = runner.load_drafter(checkpoint, step)
        cfg = runner.with_verifier_norm(drafter.cfg, verifier, "auto")
        cfg, self.served_as = served.as_served(cfg, served.ENGINES[engine])
        drafter = dataclasses.replace(drafter, cfg=cfg)
        t2d = None if drafter.vocab_maps is None else drafter.vocab_maps[1]
        frozen = runner.load_frozen(cfg, verifier, t2d)
        iv = instep.build(str(verifier), cfg, "float32", "float32")
        settings = runner.EvalSettings(
            total_seq_len=seq_len, dtype="float32", hidden_states_dtype="float32",
            hidden_states_backend=instep.BACKEND, anchors_per_call=64,
            num_draft_tokens=num_draft_tokens, served_engine=engine,
            max_new_tokens=max_new_tokens, eos_ids=runner.verifier_eos_ids(verifier),
        )  # fmt: skip
        self.ev = runner.Evaluator(drafter, frozen, settings, (iv, iv.load(None)))
        self.cfg, self.seq = cfg, seq_len
        full = load_verifier_tensors(verifier)  # the whole head: the verifier's own argmax
        head, norm = jnp.asarray(full.lm_head, jnp.float32).T, jnp.asarray(full.norm)
        eps = iv.cfg.rms_norm_eps
        gemma = cfg.verifier_norm_style == "gemma"

        chunk = 64  # positions per [chunk, V] logits block: never a whole row's [S, V]

        @jax.jit
        def top2(h):  # [S, H] last layer, before the final norm -> argmax, margin, normed x
            x = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
            x = x * ((1.0 + norm) if gemma else norm)
            n = -(-x.shape[0] // chunk)
            xs = jnp.pad(x, ((0, n * chunk - x.shape[0]), (0, 0))).reshape(n, chunk, -1)

            def block(xc):
                best, idx = jax.lax.top_k(jnp.dot(xc, head, precision=jax.lax.Precision.HIGHEST), 2)
                return idx[:, 0], best[:, 0] - best[:, 1]

            idx, margin = jax.lax.map(block, xs)
            return idx.reshape(-1)[: x.shape[0]], margin.reshape(-1)[: x.shape[0]], x

        self._top2 = top2
        self._head = np.asarray(full.lm_head, np.float32)  # [V, H] host copy, for two rows
        self._row_norms = np.linalg.norm(np.asarray(full.lm_head, np.float32), axis=-1)
        v = iv.cfg
        longest = max(v.hidden_size, v.intermediate_size or 0, v.moe_intermediate_size or 0)
        self.tie_bound = v.num_hidden_layers * longest * unit_roundoff  # x |x| (|w_a| + |w_b|)
        # The drafter's: its layers, fc and head the same way, at a stated logit scale of
        # 32 (its logits are a normed state times the verifier head's rows).
        widest = max(cfg.num_aux_layers * cfg.verifier_hidden_size, cfg.intermediate_size)
        self.draft_tie_bound = (cfg.num_hidden_layers + 2) * widest * unit_roundoff * 32

    def filled(self, tokens, n_prompt: int = 0) -> dict[str, jax.Array]:
        """The row of ``tokens`` (padded like the evaluator's) with its hidden states."""
        row = runner.pad_row(
            document_row(tokens, n_prompt, self.seq, self.cfg), self.cfg.block_size
        )
        one = {k: jnp.asarray(row[k])[None] for k in ROW_KEYS}
        return {k: v[0] for k, v in self.ev._fill(self.ev.verifier[1], one).items()}

    def greedy_next(self, tokens) -> np.ndarray:
        """The verifier's greedy token after each position of ``tokens``."""
        idx = self._top2(self.filled(tokens)["verifier_last_hidden_states"])[0]
        return np.asarray(idx)[: len(tokens)]

    def predict(self, prompt, response) -> Prediction:
        """The walk over ``response`` (the engine's tokens, its end-of-sequence token
        included when it stopped on one) after ``prompt``. For an engine that counts draft
        tokens accepted past a response's end (vLLM), the verifier's greedy continuation
        past it (one draft's worth) is computed and counted as the engine does."""
        tokens = [*prompt, *response]
        ext = []  # the verifier's greedy continuation past the end, for engines that count it
        if served.ENGINES[self.ev.settings.served_engine].counts_past_end:
            for _ in range(self.ev.num_draft):
                ext.append(int(self.greedy_next([*tokens, *ext])[-1]))
        row = document_row([*tokens, *ext], len(prompt), self.seq, self.cfg)
        _, steps = self.ev.row(row, 0, past_end=len(ext))
        idx, margin, x = self._top2(self.filled(tokens)["verifier_last_hidden_states"])
        idx, margin, x = np.asarray(idx), np.asarray(margin), np.asarray(x, np.float64)
        mismatches = []
        for t in range(len(prompt), len(tokens)):
            if tokens[t] != idx[t - 1]:
                a, b = self._head[idx[t - 1]], self._head[tokens[t]]  # the two tokens' rows
                gap = float(x[t - 1] @ (a - b))
                rows = self._row_norms[idx[t - 1]] + self._row_norms[tokens[t]]
                bound = self.tie_bound * float(np.linalg.norm(x[t - 1]) * rows)
                mismatches.append({"position": t - len(prompt), "served": int(tokens[t]),
                                   "argmax": int(idx[t - 1]), "logit_gap": gap,
                                   "bound": bound, "near_tie": gap <= bound})  # fmt: skip
        span = margin[len(prompt) - 1 : len(tokens) - 1]
        return Prediction(
            steps,
            served.counters(steps.accepted, steps.drafted, self.ev.num_draft),
            mismatches,
            float(span.min()) if span.size else float("nan"),
            float(steps.margin.min()) if steps.margin.size else float("inf"),
        )
