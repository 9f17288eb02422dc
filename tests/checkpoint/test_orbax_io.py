"""The params-only Orbax checkpoint contract (dspark_jax/checkpoint/orbax_io.py)."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from dspark_jax.checkpoint import orbax_io
from dspark_jax.checkpoint.orbax_io import CheckpointError
from tests.converters.helpers import base_config, flat_params, make_vocab, random_params


def assert_params_equal(a, b):
    fa, fb = flat_params(a), flat_params(b)
    assert set(fa) == set(fb)
    for k in fa:
        assert fa[k].dtype == np.float32, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_round_trip_exact_with_config_and_meta(tmp_path):
    cfg = base_config(markov_head_type="rnn", verifier_name_or_path="org/v")
    params = random_params(cfg, seed=1)
    step_dir = orbax_io.save_params_checkpoint(
        tmp_path / "ck", 12, cfg, params, meta={"source": "x"}
    )
    assert step_dir == (tmp_path / "ck" / "12").absolute()
    assert {"state", "meta"} <= {p.name for p in step_dir.iterdir()}
    loaded = orbax_io.load_params(tmp_path / "ck")
    assert loaded.step == 12 and loaded.cfg == cfg
    assert loaded.meta["format"] == orbax_io.FORMAT and loaded.meta["source"] == "x"
    assert loaded.meta["config"] == cfg.to_speculators_dict()
    assert isinstance(loaded.params, nnx.State)
    assert_params_equal(loaded.params, params)


def test_step_selection_latest_explicit_best(tmp_path):
    cfg = base_config()
    ck = tmp_path / "ck"
    for step, loss in ((10, 2.0), (20, 1.5), (30, 1.7)):
        orbax_io.save_params_checkpoint(
            ck, step, cfg, random_params(cfg, seed=step), meta={"metrics": {"loss": loss}}
        )
    assert orbax_io.resolve_step(ck) == 30
    assert orbax_io.resolve_step(ck, "latest") == 30
    assert orbax_io.resolve_step(ck, "best") == 20
    assert orbax_io.resolve_step(ck, "best", best_mode="max") == 10
    assert orbax_io.resolve_step(ck, "10") == 10
    assert_params_equal(orbax_io.load_params(ck, 10).params, random_params(cfg, seed=10))
    with pytest.raises(CheckpointError, match=r"no step 15 \(steps: \[10, 20, 30\]\)"):
        orbax_io.resolve_step(ck, 15)
    with pytest.raises(CheckpointError, match=r"meta\['metrics'\]\['acc'\]"):
        orbax_io.resolve_step(ck, "best", best_metric="acc")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        orbax_io.resolve_step(tmp_path / "nope")


def test_params_restore_from_a_trainer_style_state(tmp_path):
    """state may hold more than params (optimizer, rng): only params are restored."""
    cfg = base_config()
    params = random_params(cfg, seed=2)
    mngr = ocp.CheckpointManager(tmp_path / "ck", item_names=orbax_io.ITEM_NAMES)
    mngr.save(
        7,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(
                {"params": nnx.to_pure_dict(params), "opt": {"mu": np.ones(3, np.float32)}}
            ),
            meta=ocp.args.JsonSave({"step": 7, "config": cfg.to_speculators_dict()}),
        ),
    )
    mngr.wait_until_finished()
    mngr.close()
    loaded = orbax_io.load_params(tmp_path / "ck")
    assert loaded.step == 7
    assert_params_equal(loaded.params, params)


def test_refusals_name_the_problem(tmp_path):
    cfg = base_config()
    params = random_params(cfg)
    orbax_io.save_params_checkpoint(tmp_path / "ck", 1, cfg, params)
    with pytest.raises(CheckpointError, match="step 1 already exists"):
        orbax_io.save_params_checkpoint(tmp_path / "ck", 1, cfg, params)
    other = random_params(cfg, seed=5)
    orbax_io.save_params_checkpoint(tmp_path / "ck", 1, cfg, other, overwrite=True)
    assert_params_equal(orbax_io.load_params(tmp_path / "ck", 1).params, other)
    wider = random_params(base_config(markov_rank=16))
    with pytest.raises(
        CheckpointError,
        match=r"confidence_head/proj/kernel has shape \(48, 1\), the config needs \(40, 1\)",
    ):
        orbax_io.save_params_checkpoint(tmp_path / "ck", 2, cfg, wider)
    no_conf = random_params(base_config(enable_confidence_head=False))
    with pytest.raises(CheckpointError, match=r"missing \['confidence_head/proj/bias"):
        orbax_io.save_params_checkpoint(tmp_path / "ck", 2, cfg, no_conf)


def test_vocab_maps_beside_the_checkpoint(tmp_path):
    cfg = base_config(draft_vocab_size=40)
    d2t, t2d = make_vocab(cfg)
    paths = orbax_io.save_checkpoint_vocab_maps(tmp_path / "ck", cfg, d2t, t2d)
    assert [p.name for p in paths] == ["d2t-40.npy", "t2d-40.npy"]
    got = orbax_io.load_checkpoint_vocab_maps(tmp_path / "ck", cfg)
    np.testing.assert_array_equal(got[0], d2t)
    np.testing.assert_array_equal(got[1], t2d)
    assert orbax_io.load_checkpoint_vocab_maps(tmp_path / "ck", base_config()) is None
    with pytest.raises(CheckpointError, match=r"needs the vocab maps; not found: .*d2t-40\.npy"):
        orbax_io.load_checkpoint_vocab_maps(tmp_path / "other", cfg)
