"""``python -m dspark_jax.eval``: acceptance tables and confidence calibration of a drafter.

    python -m dspark_jax.eval --checkpoint runs/demo/checkpoints [--step latest|best|N] \\
        --verifier configs/demo/verifier \\
        --dataset heldout=runs/demo/heldout [--dataset code=/data/humaneval ...] \\
        --output-dir runs/demo/eval

The checkpoint is a training/params Orbax directory (:mod:`dspark_jax.checkpoint.orbax_io`) or
an exported speculators folder (``config.json`` + ``model.safetensors``; imported
into a temporary checkpoint first). Each dataset is a prepared folder with its
hidden states (the training formats), evaluated whole: rows packed to
``--total-seq-len`` (longer documents are truncated, as in training), and at every
valid anchor of every row (``--num-anchors all``, the default) or at a seeded
sample of them.

Per dataset (definitions: :mod:`dspark_jax.eval.slot_statistics`, :mod:`dspark_jax.eval.acceptance`):
acceptance by draft position and acceptance length under the analytic rule
(rejection sampling, ``sum_v min(q, p)`` chained) and greedy match, each with the
Markov head on the drafter's own tokens (free running) and on the dataset's
(teacher forcing), and the same by context length. With a confidence head: ECE,
AUROC and Brier of its prefix-survival prediction, before and after sequential
temperature scaling fitted on half of the documents and scored on the other half
(:mod:`dspark_jax.eval.calibration`); the temperatures are saved beside the checkpoint.

Outputs in ``--output-dir``: ``acceptance.md`` (also printed), ``acceptance.csv``,
``acceptance_by_context.csv``, ``calibration.csv``, ``summary.json``,
``calibration.json`` (one global temperature, what ``converters export --calibration``
folds into the confidence head), and PNG plots
``acceptance_by_position.png``, ``acceptance_by_context.png``,
``calibration_{sampled,greedy}.png`` (needs matplotlib: the ``eval`` extra).

One process, the default JAX device; the drafter and the verifier tensors must fit
on it. With ``--hidden-states-backend jax --mesh SPEC`` the verifier's weights are sharded
over the process's devices as in training, and a ``context`` axis splits each row's tokens
for its forward (the drafter's statistics, small, run replicated).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel
from dspark_jax.checkpoint import load
from dspark_jax.config import DSparkConfig, verifier_norm_style
from dspark_jax.eval import acceptance, calibration, report, served
from dspark_jax.eval.slot_statistics import row_statistics
from dspark_jax.model.draft import ROW_KEYS, DSparkDraftModel, FrozenWeights
from dspark_jax.verifier import instep
from dspark_jax.verifier.frozen import load_verifier_tensors, verifier_model_type

log = logging.getLogger("dspark_jax.eval")

ANCHOR_RULES = ("train", "full-block")
# A row's padding (outside every document) so the blocks of its last B positions exist.
_PAD = {"document_ids": -1}
# Statistics only the served walk reads (not in the tables).
_WALK_ONLY = ("draft_fr", "draft_margin_fr")
# The row arrays the served walk reads (served.row_steps' order).
_WALK_KEYS = ("input_ids", "loss_mask", "position_ids", "document_ids")
TEMPERATURES_FILE = "confidence_temperatures.json"


class EvalError(ValueError):
    """A bad flag, checkpoint or dataset (the message names it)."""


# ------------------------------------------------------------------ the drafter
@dataclasses.dataclass
class Drafter:
    cfg: DSparkConfig
    params: nnx.State  # trainable parameters (host or device arrays)
    step: int | None
    source: str  # what was loaded, for the report
    vocab_maps: tuple[np.ndarray, np.ndarray] | None  # (d2t, t2d) for a reduced vocab
    temperatures_path: Path  # where the fitted temperatures go by default


def load_drafter(
    path: str | Path,
    step: int | str | None = None,
    *,
    d2t_path: str | None = None,
    t2d_path: str | None = None,
) -> Drafter:
    """An Orbax checkpoint directory or a speculators folder -> :class:`Drafter`."""
    path = Path(path)
    try:
        loaded = load.load_drafter(path, step, d2t_path=d2t_path, t2d_path=t2d_path)
    except load.DrafterLoadError as e:
        raise EvalError(f"--checkpoint {e}") from None
    if loaded.step is None:  # a speculators folder: temperatures beside its config.json
        temps = path / TEMPERATURES_FILE
    else:
        temps = path / f"confidence_temperatures-{loaded.step}.json"
    return Drafter(loaded.cfg, loaded.params, loaded.step, str(path), loaded.vocab_maps, temps)


def with_verifier_norm(cfg: DSparkConfig, verifier: str | Path, choice: str) -> DSparkConfig:
    """``cfg`` with the targets' verifier norm convention: ``choice`` (plain/gemma), or for
    ``auto`` speculators' choice from the verifier's model_type, else the drafter's record."""
    style = choice
    if style == "auto":
        model_type = verifier_model_type(verifier)
        style = verifier_norm_style(model_type) if model_type else cfg.verifier_norm_style
    if style != cfg.verifier_norm_style:
        log.info("verifier norm: %s (the drafter records %s)", style, cfg.verifier_norm_style)
    return cfg.replace(verifier_norm_style=style)


def load_frozen(cfg: DSparkConfig, verifier: str | Path, t2d: np.ndarray | None) -> FrozenWeights:
    vt = load_verifier_tensors(verifier, t2d)
    try:
        frozen = FrozenWeights.from_verifier(vt.embed_tokens, vt.lm_head, vt.norm, cfg)
    except ValueError as e:
        raise EvalError(f"verifier {verifier} does not fit the drafter: {e}") from None
    return jax.tree.map(jnp.asarray, frozen)


# ------------------------------------------------------------------ anchors
def eligible_anchors(
    loss_mask: np.ndarray, document_ids: np.ndarray, block_size: int, rule: str = "train"
) -> np.ndarray:
    """Anchor positions of one packed row (sorted).

    ``train``: the training rule (``loss_mask[p] == 1`` and ``p < S - B``).
    ``full-block``: also every slot's position p..p+B-1 supervised and in p's document.
    """
    seq = loss_mask.shape[0]
    p = np.arange(max(seq - block_size, 0))
    ok = loss_mask[p] > 0
    if rule == "full-block":
        window = np.lib.stride_tricks.sliding_window_view(loss_mask > 0, block_size)[: p.size]
        ok &= window.all(axis=1)
        ok &= document_ids[p + block_size - 1] == document_ids[p]
        ok &= document_ids[p] >= 0
    elif rule != "train":
        raise EvalError(f"--anchor-rule must be one of {ANCHOR_RULES}, got {rule!r}")
    return p[ok].astype(np.int32)


def choose_anchors(eligible: np.ndarray, num: int | None, rng: np.random.Generator) -> np.ndarray:
    """All of them (num None) or a uniform sample of ``num`` without replacement, sorted."""
    if num is None or num >= eligible.size:
        return eligible
    return np.sort(rng.choice(eligible, size=num, replace=False)).astype(np.int32)


def anchor_groups(anchors: np.ndarray, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Static-size groups ``(anchors [size], valid [size])``, the last one padded."""
    for i in range(0, anchors.size, size):
        part = anchors[i : i + size]
        valid = np.zeros(size, bool)
        valid[: part.size] = True
        yield np.pad(part, (0, size - part.size)).astype(np.int32), valid


# ------------------------------------------------------------------ evaluation
@dataclasses.dataclass(frozen=True)
class EvalSettings:
    total_seq_len: int = 8192
    num_anchors: int | None = None  # per row; None: every eligible position
    anchor_rule: str = "train"
    anchors_per_call: int = 256
    anchor_chunk: int | None = None  # blocks per free-running chunk; None: from Vd
    vocab_chunk_tokens: int = 1024
    seed: int = 0
    max_rows: int | None = None
    dtype: str = "float32"
    hidden_states_dtype: str | None = None
    on_missing: str = "raise"
    num_workers: int = 0
    hidden_states_backend: str = "file"  # "jax": the verifier runs per row (no files)
    num_draft_tokens: int | None = None  # the engine's draft tokens; None: the drafter's
    served: bool = True  # the served-equivalent walk (drafts at every supervised position)
    served_engine: str = "vllm"  # whose end-of-response rules (served.ENGINES)
    max_new_tokens: int | None = None  # the served requests' token budget
    eos_ids: tuple[int, ...] = ()  # the verifier's end-of-sequence ids


def pad_row(row: dict[str, np.ndarray], extra: int) -> dict[str, np.ndarray]:
    """The row's ROW_KEYS arrays with ``extra`` positions of padding (document -1)."""
    return {
        k: np.concatenate([v, np.full((extra, *v.shape[1:]), _PAD.get(k, 0), v.dtype)])
        for k, v in ((k, np.asarray(row[k])) for k in ROW_KEYS)
    }


def default_anchor_chunk(draft_vocab_size: int, budget: int = 1 << 23) -> int:
    """Blocks per free-running chunk so one [chunk, Vd] fp32 array stays ~32 MB."""
    return max(1, budget // max(1, draft_vocab_size))


class Evaluator:
    """The jitted per-row statistics of one drafter, run over whole datasets."""

    def __init__(
        self,
        drafter: Drafter,
        frozen: FrozenWeights,
        settings: EvalSettings,
        verifier: tuple[instep.InStepVerifier, dict] | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ):
        """``verifier``: (in-step verifier, its loaded parameters) for
        ``--hidden-states-backend jax``: each row's hidden states are computed first;
        ``mesh``: the mesh its parameters are sharded over (None: one device)."""
        self.cfg = cfg = drafter.cfg
        self.verifier = verifier
        self.mesh = mesh
        if verifier is not None:
            self._fill = jax.jit(self._traced_fill)
        self.settings = settings
        self.num_draft = settings.num_draft_tokens or cfg.speculative_tokens
        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[settings.dtype]
        abstract = nnx.eval_shape(
            lambda: DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, remat=False)
        )
        graphdef, _ = nnx.split(abstract)
        self.params = self._replicated(jax.tree.map(jnp.asarray, drafter.params))
        self.frozen = self._replicated(frozen)
        self.d2t = None if drafter.vocab_maps is None else jnp.asarray(drafter.vocab_maps[0])
        chunk = settings.anchor_chunk or default_anchor_chunk(cfg.draft_vocab_size)

        def stats(params, frozen, row, anchors, valid, key, d2t):
            model = nnx.merge(graphdef, params)
            return row_statistics(
                model, frozen, row, anchors, valid, key, d2t=d2t, anchor_chunk=chunk,
                vocab_chunk_tokens=settings.vocab_chunk_tokens,
            )  # fmt: skip

        self._stats = jax.jit(stats)

    def _replicated(self, tree):
        """On every device of the verifier's mesh (the drafter is small), else as is."""
        if self.mesh is None:
            return tree
        return jax.device_put(tree, NamedSharding(self.mesh, P()))

    def _traced_fill(self, vparams, batch):
        if self.mesh is None:
            return self.verifier[0].fill(vparams, batch)
        with parallel.tracing_mesh(self.mesh):
            return self.verifier[0].fill(vparams, batch)

    def _verifier_row(self, padded: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The padded row with its hidden states computed; on a mesh the row is one
        batch row of the mesh's shape: over context its tokens split, over the batch
        axes (one row: nothing to split) replicated."""
        n = len(padded["input_ids"])
        if self.mesh is not None:  # to a multiple of the context split (more padding)
            split = self.mesh.shape[parallel.CONTEXT_AXIS]
            padded = pad_row(padded, -n % split)
        one = {k: np.asarray(padded[k])[None] for k in ROW_KEYS}
        if self.mesh is not None:
            tokens = NamedSharding(self.mesh, P(None, parallel.CONTEXT_AXIS))
            one = {k: jax.device_put(v, tokens) for k, v in one.items()}
        filled = self._fill(self.verifier[1], one)
        return self._replicated({k: v[0, :n] for k, v in filled.items()})

    def row(
        self, row: dict[str, np.ndarray], row_index: int, past_end: int = 0
    ) -> tuple[dict[str, np.ndarray] | None, served.ServedSteps]:
        """Statistics of the chosen anchors of one packed row (host arrays, or None when
        it has none) and the served-equivalent walk over its responses.

        The walk needs a draft at every supervised position, the last B of the row
        included: the row is padded by B positions (outside every document) so those
        blocks exist; the tables keep the training rule's anchors.
        """
        s, b = self.settings, self.cfg.block_size
        eligible = eligible_anchors(row["loss_mask"], row["document_ids"], b, s.anchor_rule)
        rng = np.random.default_rng([s.seed, row_index])
        chosen = choose_anchors(eligible, s.num_anchors, rng)
        walked = np.zeros(0, np.int32)
        if s.served:
            walked = np.flatnonzero((row["loss_mask"] > 0) & (row["document_ids"] >= 0))
        anchors = np.union1d(chosen, walked).astype(np.int32)
        if anchors.size == 0:
            return None, served.ServedSteps.empty()
        padded = pad_row(row, b)
        if self.verifier is not None:
            device_row = self._verifier_row(padded)
        else:
            device_row = {k: jnp.asarray(padded[k]) for k in ROW_KEYS}
        key = jax.random.fold_in(jax.random.key(s.seed), row_index)
        parts = []
        for g, (group, valid) in enumerate(anchor_groups(anchors, s.anchors_per_call)):
            out = self._stats(
                self.params, self.frozen, device_row, jnp.asarray(group), jnp.asarray(valid),
                jax.random.fold_in(key, g), self.d2t,
            )  # fmt: skip
            out = jax.device_get(out)
            parts.append({k: np.asarray(v)[valid] for k, v in out.items()})
        merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        steps = served.ServedSteps.empty()
        if s.served:
            start = 0 if self.cfg.sample_from_anchor else 1
            drafts = merged["draft_fr"][:, start : start + self.num_draft]
            margins = merged["draft_margin_fr"][:, start : start + self.num_draft]
            steps = served.row_steps(
                drafts, anchors, *(np.asarray(row[k]) for k in _WALK_KEYS), margins=margins,
                eos_ids=s.eos_ids, max_new_tokens=s.max_new_tokens,
                rules=served.ENGINES[s.served_engine], past_end=past_end,
            )  # fmt: skip
        keep = np.isin(anchors, chosen)
        if not keep.any():
            return None, steps
        merged = {k: v[keep] for k, v in merged.items() if k not in _WALK_ONLY}
        merged["row"] = np.full(int(keep.sum()), row_index, np.int64)
        return merged, steps

    def dataset(
        self, name: str, data_path: str | Path, hidden_states_path: str | Path | None = None
    ) -> report.DatasetBlocks:
        from dspark_jax.data.files import DataError
        from dspark_jax.data.pipeline import PackedData

        s, cfg = self.settings, self.cfg
        try:
            data = PackedData(
                data_path,
                hidden_states_path,
                total_seq_len=s.total_seq_len,
                n_aux=cfg.num_aux_layers,
                hidden_size=cfg.verifier_hidden_size,
                train_data_ratio=1.0,
                rows_per_process=1,
                process_index=0,
                process_count=1,
                seed=s.seed,
                on_missing=s.on_missing,
                hidden_states_dtype=s.hidden_states_dtype,
                aux_hidden_state_layer_ids=cfg.aux_hidden_state_layer_ids,
                tokens_only=self.verifier is not None,
            )
            if self.verifier is not None:
                instep.check_token_ids(
                    data.dataset.max_token_id(), self.verifier[0].cfg, str(data_path)
                )
        except (DataError, instep.InStepError) as e:
            raise EvalError(f"dataset {name!r}: {e}") from None
        total_rows = data.steps_per_epoch("train", 0)
        limit = total_rows if s.max_rows is None else min(total_rows, s.max_rows)
        it = data.train_iterator(num_epochs=1, num_workers=s.num_workers)
        parts, walks, rows, documents, skipped, longest = [], [], 0, 0, 0, 0
        t0 = time.time()
        try:
            for row_index, batch in enumerate(it):
                if row_index >= limit:
                    break
                skipped += int(batch["error_records"].sum())
                row = {k: batch[k][0] for k in ROW_KEYS}
                in_doc = np.asarray(row["document_ids"]) >= 0
                documents += len(np.unique(np.asarray(row["document_ids"])[in_doc]))
                if in_doc.any():  # positions count from 0 in each document
                    longest = max(longest, int(np.asarray(row["position_ids"])[in_doc].max()) + 1)
                out, steps = self.row(row, row_index)
                rows += 1
                walks.append(steps)
                if out is not None:
                    parts.append(out)
                if rows % 10 == 0 or rows == limit:
                    log.info("%s: %d/%d rows, %.1f s", name, rows, limit, time.time() - t0)
        finally:
            it.close()
        if not parts:
            raise EvalError(
                f"dataset {name!r} ({data_path}): no valid anchor in {rows} rows "
                f"(anchor rule {s.anchor_rule!r}: needs supervised tokens, loss_mask == 1)"
            )
        arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return report.DatasetBlocks(
            name, arrays, rows, documents, skipped, longest, served.ServedSteps.concat(walks)
        )


def add_realised_draws(blocks: report.DatasetBlocks, seed: int) -> None:
    """``y_sampled``: one realised accept/reject per slot, Bernoulli(accept_fr) (seeded)."""
    rng = np.random.default_rng([seed, 7])
    a = blocks.arrays["accept_fr"]
    blocks.arrays["y_sampled"] = rng.random(a.shape) < a


# ------------------------------------------------------------------ CLI
def _dataset_spec(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _anchors(text: str) -> int | None:
    if text == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'all' or a positive int, got {text!r}"
        ) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected 'all' or a positive int, got {text!r}")
    return n


def _edges(text: str) -> list[int]:
    try:
        edges = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not edges or any(e < 0 for e in edges):
        raise argparse.ArgumentTypeError(f"expected non-negative ints, got {text!r}")
    return edges


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.eval",
        description="Acceptance tables and confidence calibration of a DSpark drafter.",
    )
    g = p.add_argument_group("drafter")
    g.add_argument("--checkpoint", required=True,
                   help="Orbax checkpoint directory (training or params) or speculators folder")  # fmt: skip
    g.add_argument("--step", default="latest", help="Orbax step: an int, 'latest' or 'best'")
    g.add_argument("--verifier", default=None,
                   help="local HF folder of the verifier (default: the config's verifier path)")  # fmt: skip
    g.add_argument("--verifier-norm-style", default="auto", choices=("auto", "plain", "gemma"),
                   help="the verifier's final norm for the targets: plain x * w, gemma x * (1 + w); "
                   "auto: from the verifier config's model_type, else the drafter's record")  # fmt: skip
    g.add_argument("--d2t", default=None, help="draft vocab map d2t-<Vd>.npy (overrides)")
    g.add_argument("--t2d", default=None, help="draft vocab map t2d-<Vd>.npy (overrides)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype of the drafter")  # fmt: skip

    g = p.add_argument_group("data")
    g.add_argument("--dataset", action="append", type=_dataset_spec, required=True,
                   metavar="NAME=PATH", help="a prepared dataset folder (repeat for several)")  # fmt: skip
    g.add_argument("--hidden-states", action="append", type=_dataset_spec, default=[],
                   metavar="NAME=PATH",
                   help="hidden-state folder of dataset NAME (default PATH/hidden_states)")  # fmt: skip
    g.add_argument("--total-seq-len", type=int, default=8192, help="tokens per packed row")
    g.add_argument("--hidden-states-dtype", default=None,
                   choices=("bfloat16", "float16", "float32"), help="default: as stored")  # fmt: skip
    g.add_argument("--on-missing", default="raise", choices=("raise", "skip", "warn"))
    g.add_argument(
        "--hidden-states-backend",
        default="file",
        choices=("file", "jax"),
        help="file: hs_{i}.safetensors; jax: the verifier computes each row's hidden "
        "states (prepared dataset only)",
    )
    g.add_argument(
        "--verifier-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="--hidden-states-backend jax: the verifier's weights and matmuls",
    )
    g.add_argument(
        "--mesh",
        default=None,
        help="--hidden-states-backend jax: the verifier's weights sharded over this mesh of "
        "every device, as in training (e.g. fsdp=8, fsdp=4,tensor=2, context=8: each row's "
        "tokens split for the verifier's forward); default: one device",
    )
    g.add_argument("--max-rows", type=int, default=None, help="evaluate at most this many rows")
    g.add_argument("--num-workers", type=int, default=0, help="Grain reader processes")

    g = p.add_argument_group("anchors")
    g.add_argument("--num-anchors", type=_anchors, default=None, metavar="all|N",
                   help="anchors per row: every eligible position (default) or a seeded sample")  # fmt: skip
    g.add_argument("--anchor-rule", default="train", choices=ANCHOR_RULES,
                   help="train: loss_mask[p]==1 (as training); full-block: all B slots "
                   "supervised and in the anchor's document")  # fmt: skip
    g.add_argument("--anchors-per-call", type=int, default=256,
                   help="blocks per drafter call (one compilation)")  # fmt: skip
    g.add_argument("--anchor-chunk", type=int, default=None,
                   help="blocks per free-running vocab chunk (default: ~32 MB of logits)")  # fmt: skip
    g.add_argument("--vocab-chunk-tokens", type=int, default=1024)
    g.add_argument("--seed", type=int, default=0,
                   help="anchors, free-running draws, realised acceptances, calibration split")  # fmt: skip

    g = p.add_argument_group("report")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="positions reported (default: the drafter's speculative tokens)")  # fmt: skip
    g.add_argument("--context-buckets", type=_edges, default=list(acceptance.DEFAULT_CONTEXT_EDGES),
                   help="context-length bucket edges (comma-separated)")  # fmt: skip
    g.add_argument("--no-served", action="store_true",
                   help="skip the served-equivalent walk (it drafts at every supervised "
                   "position, whatever --num-anchors samples for the tables)")  # fmt: skip
    g.add_argument("--served-engine", default="vllm", choices=tuple(served.ENGINES),
                   help="whose rules the served-equivalent walk follows (end of a response; "
                   "llama.cpp: sliding-window draft layers bidirectional in the block)")  # fmt: skip
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="the served requests' token budget (max_tokens), for the walk")  # fmt: skip
    g.add_argument("--output-dir", default="eval_results")
    g.add_argument("--no-plots", action="store_true")

    g = p.add_argument_group("calibration")
    g.add_argument("--calibration-rule", default="sampled", choices=tuple(report.CALIBRATION_RULES),
                   help="the rule whose temperatures the file's 'temperatures' holds")  # fmt: skip
    g.add_argument("--calibration-fit-fraction", type=float, default=0.5,
                   help="share of documents STS is fitted on (the rest is reported)")  # fmt: skip
    g.add_argument("--sts-objective", default="nll", choices=calibration.OBJECTIVES)
    g.add_argument("--ece-bins", type=int, default=20)
    g.add_argument("--temperatures", default=None,
                   help="apply these saved temperatures instead of fitting (no file written)")  # fmt: skip
    g.add_argument("--temperatures-out", default=None,
                   help="where to save the fitted temperatures (default: beside the checkpoint)")  # fmt: skip
    g.add_argument("--no-save-temperatures", action="store_true")
    return p


def verifier_eos_ids(verifier: Path) -> tuple[int, ...]:
    """The end-of-sequence ids an engine stops on: ``eos_token_id`` of the verifier's
    generation_config.json and config.json (an int or a list each), and its text config's."""
    import json

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = verifier / name
        if not path.is_file():
            continue
        d = json.loads(path.read_text())
        for src in (d, d.get("text_config") or {}):
            v = src.get("eos_token_id")
            ids.update([v] if isinstance(v, int) else (v or []))
    return tuple(sorted(ids))


def _eval_mesh(spec: str | None):
    """The mesh of ``--mesh`` over every device (None: one device, no mesh). Any context
    split works: a row is padded to a multiple of it (Evaluator._verifier_row)."""
    if spec is None:
        return None
    try:
        return parallel.make_mesh(spec)
    except ValueError as e:
        raise EvalError(str(e)) from None  # parse_mesh's message names --mesh and the entry


def _resolve_verifier(args, cfg: DSparkConfig) -> Path:
    path = args.verifier or cfg.verifier_name_or_path
    if not path:
        raise EvalError("no --verifier and the drafter config names none")
    if not Path(path).is_dir():
        raise EvalError(
            f"verifier {path!r} is not a local folder (pass --verifier with a downloaded copy)"
        )
    return Path(path)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    names = [n for n, _ in args.dataset]
    if len(set(names)) != len(names):
        raise EvalError(f"--dataset names must be unique, got {names}")
    hs = dict(args.hidden_states)
    unknown = sorted(set(hs) - set(names))
    if unknown:
        raise EvalError(f"--hidden-states for unknown datasets {unknown} (datasets: {names})")
    if not 0.0 <= args.calibration_fit_fraction < 1.0:
        raise EvalError("--calibration-fit-fraction must be in [0, 1)")
    if args.anchors_per_call <= 0:
        raise EvalError("--anchors-per-call must be positive")
    if args.max_new_tokens is not None and args.max_new_tokens <= 0:
        raise EvalError("--max-new-tokens must be positive")

    step: int | str = args.step
    if step not in ("latest", "best"):
        try:
            step = int(step)
        except ValueError:
            raise EvalError(f"--step must be an int, 'latest' or 'best', got {step!r}") from None
    drafter = load_drafter(args.checkpoint, step, d2t_path=args.d2t, t2d_path=args.t2d)
    cfg = drafter.cfg
    n_draft = cfg.speculative_tokens if args.num_draft_tokens is None else args.num_draft_tokens
    if not 1 <= n_draft <= cfg.speculative_tokens:
        raise EvalError(f"--num-draft-tokens must be in [1, {cfg.speculative_tokens}]")
    verifier = _resolve_verifier(args, cfg)
    cfg = with_verifier_norm(cfg, verifier, args.verifier_norm_style)
    if not args.no_served:
        cfg, changed = served.as_served(cfg, served.ENGINES[args.served_engine])
        if changed:
            log.warning(
                "--served-engine %s: %s (every table of this run)", args.served_engine, changed
            )
    drafter = dataclasses.replace(drafter, cfg=cfg)
    frozen = load_frozen(
        cfg, verifier, None if drafter.vocab_maps is None else drafter.vocab_maps[1]
    )
    settings = EvalSettings(
        total_seq_len=args.total_seq_len,
        num_anchors=args.num_anchors,
        anchor_rule=args.anchor_rule,
        anchors_per_call=args.anchors_per_call,
        anchor_chunk=args.anchor_chunk,
        vocab_chunk_tokens=args.vocab_chunk_tokens,
        seed=args.seed,
        max_rows=args.max_rows,
        dtype=args.dtype,
        hidden_states_dtype=args.hidden_states_dtype,
        on_missing=args.on_missing,
        num_workers=args.num_workers,
        hidden_states_backend=args.hidden_states_backend,
        num_draft_tokens=n_draft,
        served=not args.no_served,
        served_engine=args.served_engine,
        max_new_tokens=args.max_new_tokens,
        eos_ids=verifier_eos_ids(verifier),
    )
    in_step, mesh = None, None
    if args.hidden_states_backend == instep.BACKEND:
        if hs:
            raise EvalError("--hidden-states: --hidden-states-backend jax reads no files")
        iv = instep.build(str(verifier), cfg, args.verifier_dtype, args.hidden_states_dtype)
        mesh = _eval_mesh(args.mesh)
        in_step = (iv, iv.load(mesh))
    elif args.mesh is not None:
        raise EvalError("--mesh applies to --hidden-states-backend jax only")
    evaluator = Evaluator(drafter, frozen, settings, in_step, mesh)
    has_conf = cfg.enable_confidence_head
    blocks = []
    for name, path in args.dataset:
        log.info("evaluating %s (%s)", name, path)
        ds = evaluator.dataset(name, path, hs.get(name))
        if has_conf:
            add_realised_draws(ds, args.seed)
        blocks.append(ds)

    given = None
    if args.temperatures and has_conf:
        given = {
            r: calibration.load_temperatures(args.temperatures, r) for r in report.CALIBRATION_RULES
        }
    info = {
        "checkpoint": drafter.source,
        "step": drafter.step,
        "verifier": str(verifier),
        "block_size": cfg.block_size,
        "sample_from_anchor": cfg.sample_from_anchor,
        "markov_head": None
        if cfg.markov_rank == 0
        else f"{cfg.markov_head_type} r{cfg.markov_rank}",
        "confidence_head": has_conf,
        "draft_vocab_size": cfg.draft_vocab_size,
        "settings": dataclasses.asdict(settings),
    }
    result = report.build_report(
        blocks,
        start=0 if cfg.sample_from_anchor else 1,
        num_draft=n_draft,
        context_edges=args.context_buckets,
        has_confidence=has_conf,
        calib_fraction=args.calibration_fit_fraction,
        calib_rule=args.calibration_rule,
        calib_objective=args.sts_objective,
        ece_bins=args.ece_bins,
        seed=args.seed,
        given_temperatures=given,
        info=info,
    )
    cal = result.get("calibration")
    if cal and given is None and not args.no_save_temperatures:
        by_rule = {r: np.asarray(t) for r, t in cal["temperatures"].items()}
        record = calibration.temperatures_record(
            by_rule,
            args.calibration_rule,
            draft_positions=n_draft,
            block_size=cfg.block_size,
            sample_from_anchor=cfg.sample_from_anchor,
            objective=args.sts_objective,
            checkpoint=drafter.source,
            step=drafter.step,
            fit={
                "datasets": names,
                "fraction": args.calibration_fit_fraction,
                "blocks": cal["fit_blocks"],
                "seed": args.seed,
            },
        )
        out = Path(args.temperatures_out) if args.temperatures_out else drafter.temperatures_path
        cal["file"] = str(calibration.save_temperatures(out, record))
    files = report.write_outputs(result, Path(args.output_dir), plots=not args.no_plots)
    if cal and cal.get("global_temperature"):
        files["calibration"] = _save_calibration(args, cal, drafter, n_draft, names)
    print(report.markdown(result), end="")
    for what, path in files.items():
        log.info("wrote %s: %s", what, path)
    if cal and cal.get("file"):
        log.info("wrote temperatures: %s", cal["file"])
    return result


def _save_calibration(args, cal: dict[str, Any], drafter: Drafter, n_draft: int, names) -> Path:
    """``<output-dir>/calibration.json``: the global temperature export folds into the head."""
    rule = args.calibration_rule
    held = cal["all"][rule]
    record = calibration.calibration_record(
        cal["global_temperature"][rule],
        rule,
        by_rule=dict(cal["global_temperature"]),
        objective=args.sts_objective,
        ece={  # on the documents outside the fitting split, all datasets pooled
            "uncalibrated": held["uncalibrated"]["summary"]["ece"],
            "calibrated": held["global"]["summary"]["ece"],
        },
        draft_positions=n_draft,
        block_size=drafter.cfg.block_size,
        sample_from_anchor=drafter.cfg.sample_from_anchor,
        checkpoint=drafter.source,
        step=drafter.step,
        fit={"datasets": names, "fraction": args.calibration_fit_fraction, "seed": args.seed},
    )
    path = Path(args.output_dir) / calibration.CALIBRATION_FILE
    return calibration.save_temperatures(path, record)


def main(argv: Sequence[str] | None = None) -> int:
    from dspark_jax.cli import guarded

    return guarded(_main, argv)


def _main(argv: Sequence[str]) -> int:
    from dspark_jax.cli import reraise_if_debug

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-restore INFO lines
    try:
        run(argv)
    except EvalError as e:
        reraise_if_debug()
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
