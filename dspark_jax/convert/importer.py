"""A speculators drafter folder -> an Orbax params checkpoint (``python -m converters import``).

* A **DSpark** folder (``speculators_model_type: dspark``) is imported as is: every
  trainable tensor must be there with its config's shape, and nothing else but the
  reduced-vocab extras ``lm_head.weight``/``d2t``/``t2d``.
* A **DFlash** folder is a warm start: its backbone (``fc``, ``hidden_norm``,
  ``layers``, ``norm``) is copied and the DSpark heads are freshly initialised
  (seeded) with the requested Markov rank/type and confidence-head options.

The result is what ``dspark_jax.train --from-pretrained`` starts from: step
``step`` of a params-only checkpoint (:mod:`dspark_jax.checkpoint.orbax_io`), plus
``d2t-<Vd>.npy``/``t2d-<Vd>.npy`` in the checkpoint root for a reduced vocabulary.
The draft ``lm_head`` is not stored (training re-reads the verifier head); when
``verifier_path`` is a local folder it is compared with the verifier's rows and a
mismatch raises (the drafter was trained against another verifier); a Hub id is
not downloaded (the comparison is skipped with a warning).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from dspark_jax.checkpoint import orbax_io as checkpoint
from dspark_jax.config import DSparkConfig, verifier_norm_style
from dspark_jax.convert.check import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, weight_files
from dspark_jax.data.vocab import VocabError, check_vocab_maps
from dspark_jax.model.params import from_speculators, speculators_key

logger = logging.getLogger(__name__)

HEAD_PREFIXES = ("markov_head.", "confidence_head.")
VOCAB_KEYS = ("lm_head.weight", "d2t", "t2d")


class ImportFolderError(ValueError):
    """The source folder cannot be imported (named file/tensor/field in the message)."""


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """DSpark head options for a DFlash warm start (speculators' flag defaults)."""

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool | None = None  # None: keep the DFlash folder's value
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ImportResult:
    cfg: DSparkConfig
    params: nnx.State
    kind: str  # "dspark" or "dflash"
    step_dir: Path
    vocab_maps: tuple[Path, Path] | None


def read_folder(folder: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json dict, {key: array})`` of a speculators folder (single file or sharded)."""
    folder = Path(folder)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.exists():
        raise ImportFolderError(f"{folder}: no {CONFIG_FILE}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ImportFolderError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ImportFolderError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
    try:
        files, _ = weight_files(folder)
    except ValueError as e:
        raise ImportFolderError(str(e)) from None
    if not files:
        raise ImportFolderError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        if not path.exists():
            raise ImportFolderError(
                f"{folder}/{INDEX_FILE} lists {path.name}, which does not exist"
            )
        try:
            with safe_open(path, "np") as f:
                for key in f.keys():
                    if key in tensors:
                        raise ImportFolderError(
                            f"{folder}: tensor {key!r} is in more than one file"
                        )
                    tensors[key] = f.get_tensor(key)
        except ImportFolderError:
            raise
        except Exception as e:  # safetensors' own error type (truncated, bad header)
            raise ImportFolderError(f"{path}: not a readable safetensors file ({e})") from None
    return config, tensors


def _is_import_step(path: Path) -> bool:
    try:
        return "source_type" in checkpoint.read_meta(path.parent, int(path.name))
    except (checkpoint.CheckpointError, ValueError, OSError):
        return False


def check_destination(ckpt_dir: Path, overwrite: bool) -> None:
    """Import only into a new or empty directory or, with ``overwrite``, over an earlier
    import: Orbax would skip the step beside a run's later steps while the run's vocab
    maps were overwritten, so a training run's directory is never written into."""
    if not ckpt_dir.exists():
        return
    if not ckpt_dir.is_dir():
        raise ImportFolderError(f"{ckpt_dir} is a file; expected a new or empty directory")
    entries = sorted(ckpt_dir.iterdir())
    if not entries:
        return
    if not overwrite:
        names = ", ".join(p.name for p in entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ImportFolderError(
            f"{ckpt_dir} is not empty ({names}); import into a new or empty directory "
            "(--overwrite replaces a step of an earlier import only)"
        )
    foreign = [p.name for p in entries if p.name.isdigit() and not _is_import_step(p)]
    if foreign or (ckpt_dir / "run.yaml").exists():
        raise ImportFolderError(
            f"{ckpt_dir} holds a training run (steps {foreign or 'and run.yaml'}), not an "
            "earlier import; --overwrite replaces imported steps only"
        )


def _vocab_maps(cfg: DSparkConfig, tensors: dict, folder: Path):
    if not cfg.uses_draft_vocab:
        return None
    if "d2t" not in tensors:
        raise ImportFolderError(
            f"{folder}: draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size} "
            "but there is no 'd2t' tensor"
        )
    d2t = np.asarray(tensors["d2t"], np.int64)
    if d2t.shape != (cfg.draft_vocab_size,):
        raise ImportFolderError(
            f"{folder}: 'd2t' has shape {d2t.shape}, expected ({cfg.draft_vocab_size},)"
        )
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"]).astype(np.bool_)
    else:  # vLLM-only folders may drop t2d: it is implied by d2t.
        ids = d2t + np.arange(len(d2t))
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ImportFolderError(f"{folder}: 'd2t' maps outside [0, {cfg.vocab_size})")
        t2d = np.zeros(cfg.vocab_size, np.bool_)
        t2d[ids] = True
    try:
        check_vocab_maps(
            d2t,
            t2d,
            draft_vocab_size=cfg.draft_vocab_size,
            verifier_vocab_size=cfg.vocab_size,
            source=f"{folder} d2t/t2d",
        )
    except VocabError as e:
        raise ImportFolderError(str(e)) from None
    return d2t, t2d


def _check_lm_head(cfg, tensors, maps, folder: Path, verifier_path) -> None:
    if not cfg.uses_draft_vocab:
        return
    if "lm_head.weight" not in tensors:
        logger.warning("%s: reduced draft vocab without lm_head.weight (vLLM needs it)", folder)
        return
    head = tensors["lm_head.weight"]
    if tuple(head.shape) != (cfg.draft_vocab_size, cfg.hidden_size):
        raise ImportFolderError(
            f"{folder}: 'lm_head.weight' has shape {tuple(head.shape)}, expected "
            f"{(cfg.draft_vocab_size, cfg.hidden_size)}"
        )
    if verifier_path is not None and not Path(verifier_path).is_dir():
        logger.warning(
            "%s: lm_head not compared with the verifier: %s is not a local folder",
            folder,
            verifier_path,
        )
    elif verifier_path is not None:
        from dspark_jax.data.verifier import VerifierWeightsError, load_verifier_tensors

        try:
            rows = load_verifier_tensors(verifier_path, maps[1]).lm_head
        except VerifierWeightsError as e:
            raise ImportFolderError(f"cannot compare {folder}'s lm_head.weight: {e}") from None
        if not np.array_equal(np.asarray(rows, np.float32).astype(head.dtype), np.asarray(head)):
            raise ImportFolderError(
                f"{folder}: 'lm_head.weight' differs from the rows t2d of the verifier head "
                f"in {verifier_path} (trained against another verifier or vocab map?)"
            )


def import_folder(
    src: str | os.PathLike,
    ckpt_dir: str | os.PathLike,
    *,
    step: int = 0,
    warm_start: WarmStart | None = None,
    verifier_path: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> ImportResult:
    """Import ``src`` into step ``step`` of the Orbax checkpoint ``ckpt_dir``.

    ``warm_start``: head options for a DFlash source (default :class:`WarmStart`);
    non-default options for a DSpark source raise (its heads come from the folder).
    """
    src = Path(src)
    check_destination(Path(ckpt_dir), overwrite)
    config, tensors = read_folder(src)
    kind = config.get("speculators_model_type")
    if kind not in ("dspark", "dflash"):
        raise ImportFolderError(
            f"{src}/{CONFIG_FILE}: speculators_model_type must be 'dspark' or 'dflash', "
            f"got {kind!r}"
        )
    try:
        src_cfg = DSparkConfig.from_speculators_dict(config, source=str(src / CONFIG_FILE))
    except ValueError as e:
        raise ImportFolderError(str(e)) from None
    if "verifier_norm_style" not in config:
        # A folder speculators wrote: it takes the convention from the verifier at load time.
        from dspark_jax.data.verifier import verifier_model_type

        verifier = verifier_path or src_cfg.verifier_name_or_path
        model_type = verifier_model_type(verifier) if verifier else None
        if model_type:
            src_cfg = src_cfg.replace(verifier_norm_style=verifier_norm_style(model_type))

    if kind == "dspark":
        if "sample_from_anchor" not in config:
            raise ImportFolderError(
                f"{src}/{CONFIG_FILE}: no 'sample_from_anchor': ambiguous (speculators' DSpark "
                "reads it as True, vLLM as False); add it to the config"
            )
        if warm_start is not None and warm_start != WarmStart():
            raise ImportFolderError(
                f"{src} is a DSpark folder: its heads are imported, warm-start options apply "
                "to DFlash folders only"
            )
        cfg = src_cfg
        params = checkpoint.abstract_params(cfg)
        keep_missing: tuple[str, ...] = ()
    else:
        ws = warm_start or WarmStart()
        try:
            cfg = src_cfg.replace(
                markov_rank=ws.markov_rank,
                markov_head_type=ws.markov_head_type,
                enable_confidence_head=ws.enable_confidence_head,
                confidence_head_with_markov=ws.confidence_head_with_markov,
                sample_from_anchor=(
                    src_cfg.sample_from_anchor
                    if ws.sample_from_anchor is None
                    else ws.sample_from_anchor
                ),
            )
        except ValueError as e:
            raise ImportFolderError(f"warm start of {src}: {e}") from None
        from dspark_jax.model.draft import DSparkDraftModel

        model = DSparkDraftModel(cfg, rngs=nnx.Rngs(ws.seed), dtype=jnp.float32, remat=False)
        params = nnx.state(model, nnx.Param)
        params = nnx.from_flat_state(
            [(p, v.replace(np.asarray(v[...]))) for p, v in nnx.to_flat_state(params)]
        )
        keep_missing = HEAD_PREFIXES
        stray = sorted(k for k in tensors if k.startswith(HEAD_PREFIXES))
        if stray:
            raise ImportFolderError(f"{src}: a DFlash folder with DSpark head tensors {stray}")

    maps = _vocab_maps(cfg, tensors, src)
    _check_lm_head(cfg, tensors, maps, src, verifier_path)
    known = {speculators_key(p)[0] for p, _ in nnx.to_flat_state(params)}
    if keep_missing:
        known = {k for k in known if not k.startswith(keep_missing)}
    allowed_extra = set(VOCAB_KEYS) if cfg.uses_draft_vocab else set()
    unexpected = sorted(set(tensors) - known - allowed_extra)
    if unexpected:
        raise ImportFolderError(
            f"{src}: unexpected tensors {unexpected} for a {kind} drafter with this config "
            f"(expected the trainable tensors{', lm_head, d2t, t2d' if allowed_extra else ''})"
        )
    floats = {k: np.asarray(v, np.float32) for k, v in tensors.items() if k not in VOCAB_KEYS}
    try:
        params = from_speculators(floats, params, keep_missing=keep_missing)
    except (KeyError, ValueError) as e:
        raise ImportFolderError(f"{src}: {e.args[0]}") from None

    meta = {"source": str(src.absolute()), "source_type": kind}
    if kind == "dflash":
        meta["warm_start"] = dataclasses.asdict(warm_start or WarmStart())
    vocab_paths = None
    if maps is not None:
        vocab_paths = checkpoint.vocab_map_paths(ckpt_dir, cfg)
        meta["vocab_maps"] = {"d2t": vocab_paths[0].name, "t2d": vocab_paths[1].name}
    step_dir = checkpoint.save_params_checkpoint(
        ckpt_dir, step, cfg, params, meta=meta, overwrite=overwrite
    )
    if maps is not None:
        vocab_paths = checkpoint.save_checkpoint_vocab_maps(ckpt_dir, cfg, *maps)
    return ImportResult(
        cfg=cfg, params=params, kind=kind, step_dir=step_dir, vocab_maps=vocab_paths
    )
