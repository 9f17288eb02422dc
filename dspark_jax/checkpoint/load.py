"""The one drafter loader: an Orbax checkpoint directory or a speculators folder ->
config, trainable params and vocab maps (used by ``--from-pretrained``, eval and
``python -m converters import``).

One pass down, each file read once: open the checkpoint step or the folder, read its
config, build the model's parameter tree, fill it, attach the vocabulary maps. A
folder is read as ``python -m converters import`` reads it (:func:`read_drafter`):

* a **DSpark** folder (``speculators_model_type: dspark``) as is: every trainable
  tensor must be there with its config's shape, and nothing else but the
  reduced-vocab extras ``lm_head.weight``/``d2t``/``t2d``;
* a **DFlash** folder as a warm start: its backbone (``fc``, ``hidden_norm``,
  ``layers``, ``norm``) is copied and the DSpark heads are freshly initialised
  (seeded) with the requested Markov rank/type and confidence-head options.

The draft ``lm_head`` is not kept (training re-reads the verifier head); when
``verifier_path`` is a local folder it is compared with the verifier's rows and a
mismatch raises (the drafter was trained against another verifier); a Hub id is not
downloaded (the comparison is skipped with a warning).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoint import orbax_io
from dspark_jax.checkpoint.folder import ImportFolderError, read_folder
from dspark_jax.config import DSparkConfig, verifier_norm_style
from dspark_jax.data.vocab import VocabError, check_vocab_maps
from dspark_jax.hf_folder import CONFIG_FILE, has_weights
from dspark_jax.model.params import from_speculators, speculators_key, to_host

logger = logging.getLogger(__name__)

HEAD_PREFIXES = ("markov_head.", "confidence_head.")
VOCAB_KEYS = ("lm_head.weight", "d2t", "t2d")


class DrafterLoadError(ValueError):
    """The path holds no loadable drafter (the message names the path and the problem)."""


@dataclasses.dataclass(frozen=True)
class LoadedDrafter:
    cfg: DSparkConfig
    params: nnx.State  # trainable parameters, host numpy arrays
    step: int | None  # the checkpoint step; None for a speculators folder
    vocab_maps: tuple[np.ndarray, np.ndarray] | None  # (d2t, t2d) for a reduced vocab
    source: str  # what was loaded, for logs and reports
    meta: dict = dataclasses.field(default_factory=dict)  # the step's meta (checkpoints)


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
class FolderDrafter:
    """A speculators folder read into the trainer's terms (:func:`read_drafter`)."""

    cfg: DSparkConfig
    params: nnx.State  # trainable parameters, fp32 numpy leaves
    kind: str  # "dspark" or "dflash"
    vocab_maps: tuple[np.ndarray, np.ndarray] | None  # (d2t, t2d) from the folder


def has_checkpoint_steps(path: Path) -> bool:
    """A training ``--save-path`` holds config.json beside numbered step folders: that is
    a checkpoint, not a speculators folder."""
    return any(p.is_dir() and p.name.isdigit() for p in path.iterdir())


def load_drafter(
    path: str | os.PathLike,
    step: int | str | None = "latest",
    *,
    verifier_path: str | os.PathLike | None = None,
    d2t_path: str | os.PathLike | None = None,
    t2d_path: str | os.PathLike | None = None,
) -> LoadedDrafter:
    """Load step ``step`` (N, ``latest`` or ``best``) of an Orbax checkpoint, or a
    speculators folder (config.json + model.safetensors; ``step`` is ignored).

    A folder is read as ``python -m converters import`` would, with the same checks
    (``verifier_path``: compare its lm_head with the verifier's rows). Explicit
    ``d2t_path``/``t2d_path`` win over the maps stored with the drafter.
    """
    path = Path(path)
    if not path.is_dir():
        raise DrafterLoadError(f"{path}: no such directory")
    try:
        if not has_checkpoint_steps(path) and has_weights(path):
            # config.json and the weights, each read once -> config -> model -> params
            drafter = read_drafter(path, verifier_path=verifier_path)
            cfg, params, maps = drafter.cfg, to_host(drafter.params), drafter.vocab_maps
            step, source = None, f"speculators folder {path}"
        else:
            return load_checkpoint(path, step, d2t_path=d2t_path, t2d_path=t2d_path)
        # Explicit vocab maps win over those stored with the drafter.
        if d2t_path is not None or t2d_path is not None:
            maps = orbax_io.load_checkpoint_vocab_maps(path, cfg, d2t_path, t2d_path)
    except (ImportFolderError, orbax_io.CheckpointError) as e:
        raise DrafterLoadError(str(e)) from None
    return LoadedDrafter(cfg, params, step, maps, source)


def load_checkpoint(
    path: str | os.PathLike,
    step: int | str | None = "latest",
    *,
    best_metric: str = "loss",
    best_mode: str = "min",
    d2t_path: str | os.PathLike | None = None,
    t2d_path: str | os.PathLike | None = None,
) -> LoadedDrafter:
    """Step ``step`` of an Orbax checkpoint (N, ``latest``, or ``best`` by ``best_metric``
    and ``best_mode``) with its meta and vocab maps (``d2t_path``/``t2d_path``, else the
    ones beside the steps). Raises CheckpointError (VocabError for the maps)."""
    loaded = orbax_io.load_params(path, step, best_metric=best_metric, best_mode=best_mode)
    maps = orbax_io.load_checkpoint_vocab_maps(path, loaded.cfg, d2t_path, t2d_path)
    source = f"Orbax checkpoint {path} step {loaded.step}"
    return LoadedDrafter(loaded.cfg, loaded.params, loaded.step, maps, source, loaded.meta)


def read_drafter(
    src: str | os.PathLike,
    *,
    warm_start: WarmStart | None = None,
    verifier_path: str | os.PathLike | None = None,
) -> FolderDrafter:
    """A speculators DSpark or DFlash folder -> config, filled params and vocab maps.

    ``warm_start``: head options for a DFlash source (default :class:`WarmStart`);
    non-default options for a DSpark source raise (its heads come from the folder).
    Every problem raises :class:`ImportFolderError` naming the file, tensor or field.
    """
    src = Path(src)
    config, tensors = read_folder(src)  # config.json and the weights, each read once
    kind, cfg = _folder_config(src, config, warm_start, verifier_path)
    if kind == "dspark":
        params = orbax_io.abstract_params(cfg)
        keep_missing: tuple[str, ...] = ()
    else:  # a warm start: the heads keep their fresh values
        params = _initial_params(cfg, (warm_start or WarmStart()).seed)
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
    return FolderDrafter(cfg=cfg, params=params, kind=kind, vocab_maps=maps)


def _folder_config(
    src: Path, config: dict, warm_start: WarmStart | None, verifier_path
) -> tuple[str, DSparkConfig]:
    """``(kind, config)`` of the drafter a folder's config.json describes."""
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
        from dspark_jax.verifier.frozen import verifier_model_type

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
        return kind, src_cfg
    ws = warm_start or WarmStart()
    try:
        return kind, src_cfg.replace(
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


def _initial_params(cfg: DSparkConfig, seed: int) -> nnx.State:
    """Freshly initialised trainable params (fp32 numpy leaves) of ``cfg``."""
    from dspark_jax.model.draft import DSparkDraftModel

    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32, remat=False)
    params = nnx.state(model, nnx.Param)
    return nnx.from_flat_state(
        [(p, v.replace(np.asarray(v[...]))) for p, v in nnx.to_flat_state(params)]
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
        from dspark_jax.verifier.frozen import VerifierWeightsError, load_verifier_tensors

        try:
            rows = load_verifier_tensors(verifier_path, maps[1]).lm_head
        except VerifierWeightsError as e:
            raise ImportFolderError(f"cannot compare {folder}'s lm_head.weight: {e}") from None
        if not np.array_equal(np.asarray(rows, np.float32).astype(head.dtype), np.asarray(head)):
            raise ImportFolderError(
                f"{folder}: 'lm_head.weight' differs from the rows t2d of the verifier head "
                f"in {verifier_path} (trained against another verifier or vocab map?)"
            )
