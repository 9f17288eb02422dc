"""dspark_jax.optim against speculators 0.9.0's own optimiser construction and step order.

The reference side is built by the reference's code: ``build_optimizers`` (called
through ``Trainer.setup_optimizer``, which also makes the LambdaLR schedulers with
``_resolve_scheduler_steps``) on the reference DSparkDraftModel holding our initial
weights, and stepped like ``Trainer.train_epoch``: set grads, ``clip_grad_norm_(
model.parameters(), 1.0)``, ``_optimizers_step``, read the lrs, ``_schedulers_step``.
Our side: ``build_optimizer`` on the Flax param tree with the same flags, fed the
same (large, so clipping is active) fixed random gradients.

Tolerances (fp32 on CPU). AdamW: both sides compute the same fp32 formulas with
different roundings (optax divides v by its bias correction before the sqrt, torch
after; decay is folded into the update instead of a separate multiply), a few ulps
of the parameter: atol 2e-7 (params are O(0.1-1), lr 2e-2). Muon: the
Newton-Schulz iteration runs on bf16 operands on both sides with the same operation
order (fp32 accumulation, one rounding per addmm); for these small matrices it is
bit-identical on the machines we tried, but the fp32 accumulation order inside a
matmul is the BLAS's business (oneDNN vs XLA:CPU, or a GPU), and a flipped
rounding moves an entry of the orthogonalised update by a bf16 ulp (2^-8
relative) or two. We allow that: per step, |ours - ref| <= 2^-7 * lr_adj * max|O|
accumulated over the steps, plus the fp32 floor. Learning rates: rtol 1e-6 (our
schedule runs in fp32; the reference's lambda in float64).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.reference

import optax  # noqa: E402
from flax import nnx  # noqa: E402

from dspark_jax import optim  # noqa: E402
from dspark_jax.model.draft import DSparkDraftModel  # noqa: E402
from dspark_jax.model.params import leaf_key, to_speculators  # noqa: E402
from tests.reference.harness import build_reference_model  # noqa: E402
from tests.reference.test_model_parity import base_config, make_frozen  # noqa: E402

TOTAL = 6  # scheduler horizon = steps run; warmup int(6 * 0.34) = 2
STEPS = 6
GRAD_SCALE = 3.0  # global grad norm ~ 3 * sqrt(#elements) >> 1: clipping always active


def _setup(seed: int = 0):
    cfg = base_config()
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32, remat=False)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    frozen, t2d = make_frozen(np.random.default_rng(seed), cfg)
    ref = build_reference_model(cfg, nnx.state(model, nnx.Param), frozen, t2d)
    return params, ref


def _grad_sequence(ref, steps: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            n: (GRAD_SCALE * rng.standard_normal(tuple(p.shape))).astype(np.float32)
            for n, p in ref.named_parameters()
            if p.requires_grad
        }
        for _ in range(steps)
    ]


def _to_our_grads(params, grads: dict[str, np.ndarray]):
    def leaf(path, x):
        key, transpose = leaf_key((path))
        g = grads[key]
        return jnp.asarray(g.T if transpose else g)

    return jax.tree_util.tree_map_with_path(leaf, params)


def _run_reference(ref, flags: dict, grads_seq):
    from speculators.train.trainer import Trainer, TrainerConfig

    config = TrainerConfig(lr=flags["lr"], num_epochs=1, save_path="unused", **flags["extra"])
    fake = types.SimpleNamespace(
        model=ref,
        config=config,
        resume_from_checkpoint=False,
        checkpointer=types.SimpleNamespace(previous_epoch=-1),
        train_loader=range(TOTAL),  # len() = steps per epoch -> total = epochs * len
    )
    Trainer.setup_optimizer(fake)  # build_optimizers + LambdaLR schedulers, as the trainer does
    snapshots, lrs, norms = [], [], []
    for grads in grads_seq:
        Trainer._optimizers_zero_grad(fake)
        for n, p in ref.named_parameters():
            if p.requires_grad:
                p.grad = torch.from_numpy(grads[n].copy())
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        Trainer._optimizers_step(fake)
        lrs.append({type(opt).__name__: opt.param_groups[0]["lr"] for opt in fake.optimizers})
        Trainer._schedulers_step(fake)
        snapshots.append(
            {n: p.detach().numpy().copy() for n, p in ref.named_parameters() if p.requires_grad}
        )
    return fake.optimizers, snapshots, lrs, norms


def _run_ours(params, flags: dict, grads_seq):
    tx, schedules = optim.build_optimizer(params, total_steps=TOTAL, **flags["ours"])
    state = tx.init(params)

    @jax.jit
    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    snapshots, lrs, norms = [], [], []
    for i, grads in enumerate(grads_seq):
        g = _to_our_grads(params, grads)
        norms.append(float(jax.jit(optim.global_grad_norm)(g)))
        lrs.append({k: float(s(i)) for k, s in schedules.items()})
        params, state = step(params, state, g)
        snapshots.append(to_speculators(params))
    return state, snapshots, lrs, norms


CASES = {
    # name: flags (reference TrainerConfig fields / our build_optimizer kwargs)
    "muon-cosine-warmup": dict(
        lr=2e-2,
        extra=dict(
            optimizer="muon",
            muon_lr=5e-2,
            scheduler_type="cosine",
            scheduler_warmup_ratio=0.34,
        ),
        ours=dict(
            optimizer="muon", lr=2e-2, muon_lr=5e-2, scheduler_type="cosine", warmup_ratio=0.34
        ),
    ),
    "muon-original-linear-warmupsteps": dict(
        lr=1e-2,
        extra=dict(
            optimizer="muon",
            muon_lr=3e-2,
            muon_adjust_lr_fn="original",
            muon_weight_decay=0.5,
            scheduler_type="linear",
            scheduler_warmup_steps=1,
        ),
        ours=dict(
            optimizer="muon",
            lr=1e-2,
            muon_lr=3e-2,
            muon_adjust_lr_fn="original",
            muon_weight_decay=0.5,
            scheduler_type="linear",
            warmup_steps=1,
        ),
    ),
    "adamw-cosine-warmup": dict(
        lr=2e-2,
        extra=dict(optimizer="adamw", scheduler_type="cosine", scheduler_warmup_ratio=0.34),
        ours=dict(optimizer="adamw", lr=2e-2, scheduler_type="cosine", warmup_ratio=0.34),
    ),
    "adamw-constant": dict(
        lr=1e-2,
        extra=dict(optimizer="adamw", scheduler_type="none", weight_decay=0.3),
        ours=dict(optimizer="adamw", lr=1e-2, scheduler_type="none", weight_decay=0.3),
    ),
}


@pytest.fixture(scope="module")
def setup():
    params, ref = _setup()
    init = {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}
    return params, ref, init


def _fresh_reference(ref, init):
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(torch.from_numpy(init[n]))
            p.grad = None
    return ref


def test_partition_matches_reference(setup):
    from speculators.train.optimizers import split_named_params_for_muon

    params, ref, _ = setup
    muon_ref, adamw_ref = split_named_params_for_muon(ref)
    assert optim.muon_param_keys(params) == sorted(n for n, _ in muon_ref)
    labels = {
        leaf_key((p))[0]: lab
        for p, lab in jax.tree_util.tree_flatten_with_path(optim.param_labels(params))[0]
    }
    assert sorted(k for k, v in labels.items() if v == "adamw") == sorted(n for n, _ in adamw_ref)


@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_reference(setup, case):
    flags = CASES[case]
    params, ref, init = setup
    ref = _fresh_reference(ref, init)
    grads_seq = _grad_sequence(ref, STEPS)
    ref_opts, ref_snaps, ref_lrs, ref_norms = _run_reference(ref, flags, grads_seq)
    state, our_snaps, our_lrs, our_norms = _run_ours(params, flags, grads_seq)

    # clipping active and the same pre-clip norm
    assert min(ref_norms) > 10.0
    np.testing.assert_allclose(our_norms, ref_norms, rtol=1e-6)

    # lr of every update: reference (float64 lambda) vs our fp32 schedule
    name = {"Muon": "muon", "AdamW": "adamw"}
    for ref_lr, our_lr in zip(ref_lrs, our_lrs, strict=True):
        assert {name[k] for k in ref_lr} == set(our_lr)
        for k, v in ref_lr.items():
            np.testing.assert_allclose(our_lr[name[k]], v, rtol=1e-6, atol=1e-12)
    if flags["ours"].get("scheduler_type") != "none":
        assert all(
            v == 0.0 for v in ref_lrs[0].values()
        )  # warmup: the first update uses lambda(0) = 0

    muon_keys = (
        set(optim.muon_param_keys(params)) if flags["ours"]["optimizer"] == "muon" else set()
    )
    budget = {k: 0.0 for k in init}
    for step, (r, o) in enumerate(zip(ref_snaps, our_snaps, strict=True)):
        prev = init if step == 0 else ref_snaps[step - 1]
        for k in r:
            if k in muon_keys:
                lr = ref_lrs[step]["Muon"]
                ratio = optim.muon_lr_ratio(
                    r[k].shape, flags["ours"].get("muon_adjust_lr_fn", "match_rms_adamw")
                )
                # |O| <= ~1.2 after 5 NS steps; BLAS-order flips move entries by <= 2^-6 max|O|
                budget[k] += lr * ratio * 2.0**-6 * 1.2
            tol = budget[k] + 2e-7 + 4e-7 * np.abs(prev[k]).max()
            np.testing.assert_allclose(
                o[k], r[k], rtol=0, atol=tol, err_msg=f"{case} step {step} {k}"
            )
        # and the step moved the parameters (lr > 0 after warmup step 0)
    moved = max(np.abs(our_snaps[-1][k] - init[k]).max() for k in init if k in our_snaps[-1])
    assert moved > 1e-3

    if muon_keys:  # momentum buffers: torch state vs ours (pure fp32 EMA, same lerps)
        muon_opt = ref_opts[0]
        assert type(muon_opt).__name__ == "Muon"
        by_id = {id(p): n for n, p in ref.named_parameters()}
        ref_buf = {by_id[id(p)]: s["momentum_buffer"].numpy() for p, s in muon_opt.state.items()}
        our_state = [
            x
            for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optim.TorchMuonState))
            if isinstance(x, optim.TorchMuonState)
        ]
        assert len(our_state) == 1
        ours_buf = {}
        for path, b in jax.tree_util.tree_flatten_with_path(our_state[0].momentum_buffer)[0]:
            key, transpose = leaf_key((path))
            ours_buf[key] = np.asarray(b.T if transpose else b)
        assert set(ours_buf) == set(ref_buf) == muon_keys
        for k in muon_keys:
            np.testing.assert_allclose(ours_buf[k], ref_buf[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize(
    "shape", [(32, 32), (16, 32), (64, 32), (2, 40), (40, 2), (8, 8), (256, 128)]
)
def test_newton_schulz_matches_torch(shape):
    """Our bf16 NS on the torch layout vs torch.optim._muon._zeropower_via_newtonschulz."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = (np.random.default_rng(sum(shape)).standard_normal(shape) * 0.01).astype(np.float32)
    ref = _zeropower_via_newtonschulz(
        torch.from_numpy(g), optim.MUON_NS_COEFFICIENTS, 5, optim.MUON_EPS
    )
    ref = ref.float().numpy()
    ours = np.asarray(jax.jit(optim.newton_schulz_torch)(jnp.asarray(g)).astype(jnp.float32))
    # bit-identical here up to 64 x 64 (a single entry off in ~1 of 10 seeds); larger
    # ones differ by the BLAS's fp32 accumulation order (see module doc): observed
    # max 2^-7.8 * max|O|, mean 7e-4 * mean|O| at 256 x 128.
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2.0**-6 * np.abs(ref).max())
    assert np.abs(ours - ref).mean() <= 2.0**-8 * np.abs(ref).mean()


def test_lr_lambdas_match_transformers():
    """Every step (incl. past the horizon) of both schedule types vs transformers' lambdas."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    for total, warm, cycles in [(50, 5, 0.5), (40, 0, 0.5), (30, 7, 1.25)]:
        for kind in ("linear", "cosine"):
            p = torch.nn.Parameter(torch.zeros(1))
            opt = torch.optim.AdamW([p], lr=3e-3)
            if kind == "linear":
                sch = get_linear_schedule_with_warmup(opt, warm, total)
            else:
                sch = get_cosine_schedule_with_warmup(opt, warm, total, num_cycles=cycles)
            ours = optim.make_schedule(
                3e-3,
                scheduler_type=kind,
                warmup_steps=warm,
                total_steps=total,
                num_cosine_cycles=cycles,
            )
            ref_lrs = []
            for _ in range(total + 10):
                ref_lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                sch.step()
            got = np.asarray(jax.vmap(ours)(jnp.arange(total + 10)))
            # fp32 schedule vs float64 lambda: a few fp32 ulps of the base lr
            np.testing.assert_allclose(
                got, ref_lrs, rtol=0, atol=3e-3 * 1e-6, err_msg=f"{kind} {total} {warm}"
            )
            py = [
                3e-3
                * optim.lr_lambda(
                    s,
                    scheduler_type=kind,
                    warmup_steps=warm,
                    total_steps=total,
                    num_cosine_cycles=cycles,
                )
                for s in range(total + 10)
            ]
            np.testing.assert_allclose(py, ref_lrs, rtol=1e-12, atol=0)


def test_resolve_scheduler_steps_matches_reference():
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps

    for kw in (
        {},
        {"scheduler_warmup_ratio": 0.05},
        {"scheduler_warmup_ratio": 0.333},
        {"scheduler_warmup_steps": 7},
        {"scheduler_total_steps": 321},
        {"max_steps": 77},
    ):
        cfg = TrainerConfig(lr=1e-3, num_epochs=3, save_path="unused", **kw)
        ref = _resolve_scheduler_steps(cfg, 250)
        total = kw.get("scheduler_total_steps") or kw.get("max_steps") or 3 * 250
        ours = optim.resolve_scheduler_steps(
            total, kw.get("scheduler_warmup_steps"), kw.get("scheduler_warmup_ratio")
        )
        assert ours == ref, kw


def test_defaults_match_reference_cli():
    from speculators.train.config.schema import OptimizerArgs, SchedulerArgs

    ref = {**OptimizerArgs().model_dump(), **SchedulerArgs().model_dump()}
    for k, v in optim.CLI_DEFAULTS.items():
        assert ref[k] == v, k
