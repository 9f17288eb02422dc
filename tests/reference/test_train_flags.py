"""``python -m dspark_jax.train`` has every flag of ``speculators train`` 0.9.0, with the
same spelling, type, choices and (resolved, for dspark) default.

The reference side is its own parser (``config.resolution.build_parser``) and its own
default resolution (``TrainConfig`` with ``speculator_type="dspark"`` plus the hidden
states backends' defaults). Deliberate differences are listed in DEVIATIONS.
"""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("speculators")
pytestmark = pytest.mark.reference

from dspark_jax.train import flags as cli

# dest -> why our default differs (see dspark_jax/train/flags.py).
DEVIATIONS = {
    "speculator_type": "dspark is the only type trained here (reference: eagle3)",
    "verifier_name_or_path": "required in both; the reference's placeholder default is ''",
}
# Left None by the reference's config and resolved by its model class (dspark: True).
RESOLVED_BY_MODEL = {"sample_from_anchor": True}
# Ours only: the Kimi-K3 branch's flag, D-PARD's (speculators PR #1078, unmerged),
# Draft-OPD's (speculators docs/draft-opd.md, a branch; opd_drafting ours) and the JAX flags.
OPD = {"training_stage", "gamma_opd", "lambda_acc", "lambda_rej", "opd_drafting"}
EXTRA = (
    {"mooncake_writer_threads", "dpard_alpha"}
    | OPD
    | {f.dest for f in cli.FLAGS if f.group == "jax"}
)
# Choices we add to a reference flag: D-PARD (docs/math.md §7), the in-step verifier
# (docs/design.md, "In-step verifier").
EXTRA_CHOICES = {"per_position_loss_weight": ["dpard"], "hidden_states_backend": ["jax"]}


@pytest.fixture(scope="module")
def reference():
    from speculators.train.config.resolution import _BACKEND_ACTIONS, build_parser
    from speculators.train.config.schema import TrainConfig

    parser = build_parser()
    actions = {
        a.dest: a for a in parser._actions if a.dest not in ("help", "config", "dump_config")
    }
    defaults = TrainConfig(speculator_type="dspark").flatten()
    for backend_actions in _BACKEND_ACTIONS.values():
        for a in backend_actions:
            defaults.setdefault(a.dest, a.default)
    return actions, defaults


def test_every_reference_flag_exists_with_the_same_spelling_and_choices(reference):
    actions, _ = reference
    ours = {a.dest: a for a in cli.build_parser()._actions}
    missing = sorted(set(actions) - set(ours))
    assert not missing, missing
    assert set(ours) - set(actions) - {"help", "config", "dump_config"} == EXTRA
    for dest, ref in actions.items():
        mine = ours[dest]
        assert mine.option_strings == ref.option_strings, dest
        assert type(mine) is type(ref), dest  # store / store_true / --x/--no-x
        assert (mine.nargs, mine.type or str) == (ref.nargs, ref.type or str), dest
        extra = EXTRA_CHOICES.get(dest, [])
        assert list(mine.choices or []) == [*(ref.choices or []), *extra], dest


def test_resolved_defaults_equal_the_references_for_dspark(reference):
    actions, defaults = reference
    ours = cli.resolve(["--verifier-name-or-path", "/v"]).values
    for dest in actions:
        if dest in DEVIATIONS:
            continue
        if dest in RESOLVED_BY_MODEL:
            assert (defaults[dest], ours[dest]) == (None, RESOLVED_BY_MODEL[dest])
            continue
        assert ours[dest] == defaults[dest], (dest, ours[dest], defaults[dest])
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)


def test_normalize_counted_metrics_is_the_references():
    from speculators.train.utils import normalize_counted_metrics as reference

    from dspark_jax.train.metrics_log import normalize_counted_metrics

    metrics = {"loss_sum": 3.0, "loss_total": 2.0, "accept_len_sum": 1.0, "accept_len_total": 0.0,
               "orphan_total": 4.0, "other": 6.0}  # fmt: skip
    for world in (1, 3):
        assert normalize_counted_metrics(dict(metrics), world) == reference(dict(metrics), world)


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_the_trackers_config_record_is_the_references(backend):
    """flags.run_config: the record the reference's log_run_config hands its trackers
    (``TrainConfig.model_dump`` + ``hidden_states_backend_args``), flattened as they are;
    ours has the JAX flags (``jax/...``), mooncake_writer_threads, dpard_alpha and
    Draft-OPD's besides."""
    from speculators.train.config.resolution import resolve
    from speculators.train.config.schema import TrainConfig
    from speculators.train.logger import _flatten_dict

    argv = ["--verifier-name-or-path", "/v", "--speculator-type", "dspark", "--lr", "0.01",
            "--logger", "wandb", "--hidden-states-backend", backend]  # fmt: skip
    if backend == "mooncake":
        argv += ["--mooncake-master", "10.0.0.1:50051"]
    ref_cfg = resolve(TrainConfig, argv)
    ref = ref_cfg.model_dump(mode="json")
    if ref_cfg.backend_args:
        ref["hidden_states_backend_args"] = dict(ref_cfg.backend_args)
    ref = _flatten_dict(ref)
    ours = _flatten_dict(cli.run_config(cli.resolve(argv)))
    extra = (
        {k for k in ours if k.startswith("jax/")}
        | {"dflash/dpard_alpha"}
        | {f"loss/{d}" for d in OPD}
    )
    if backend == "mooncake":
        extra.add("hidden_states_backend_args/mooncake_writer_threads")
    assert set(ours) - set(ref) == extra
    assert set(ref) == set(ours) - extra
    for k, v in ref.items():
        if k.split("/")[-1] in DEVIATIONS or k.split("/")[-1] in RESOLVED_BY_MODEL:
            continue
        mine = ours[k]
        assert mine == v or list(mine) == v, (k, mine, v)
