"""Initial parameters: each tensor drawn from the distribution speculators 0.9.0 uses.

The reference ``DSparkDraftModel.__init__`` builds the DFlash trunk, runs ``post_init``
(HF ``_init_weights``: Linear N(0, 0.02), bias 0, norms 1) and only *then* builds the
Markov and confidence heads, so their Linear layers keep torch's default init
(kaiming-uniform a=sqrt(5): weight and bias U(+-1/sqrt(fan_in))) and W1 its explicit
N(0, 0.01). A head initialised otherwise trains differently: the confidence BCE's
gradient reaches the trunk and W1 (issue 19).

Values of each tensor are pooled over ``SEEDS`` inits here and ``REF_SEEDS`` in the
reference and compared with two-sample Kolmogorov-Smirnov tests, of the values and of
their magnitudes, each at a 1e-6 false-alarm rate (critical value from the DKW bound); constant tensors must be
equal; a tensor random in the reference must be random here.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.reference

from flax import nnx  # noqa: E402

from dspark_jax.model.draft import DSparkDraftModel  # noqa: E402
from dspark_jax.model.params import to_speculators  # noqa: E402
from launch.speculators_config import reference_config  # noqa: E402
from tests.tiny_configs import base_config  # noqa: E402

# Draws per side: the smallest random tensor (the confidence head's one bias) then has
# 64 values here and 128 in the reference, enough for the |x| test below to tell its
# U(+-1/sqrt(fan_in)) from HF's N(0, 0.02) (KS distance ~0.7 against a critical 0.45).
SEEDS = 64
REF_SEEDS = 128
ALPHA = 1e-6  # per test; two tests per tensor (x and |x|): 2e-6 per tensor


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample KS statistic sup |F_a - F_b|."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def _ks_critical(n: int, m: int) -> float:
    return math.sqrt(-math.log(ALPHA / 2) / 2) * math.sqrt((n + m) / (n * m))


def _pooled_ours(cfg) -> dict[str, np.ndarray]:
    """Our init, jitted once per config (one compile, then SEEDS cheap draws)."""

    @jax.jit
    def init(key):
        return nnx.state(DSparkDraftModel(cfg, rngs=nnx.Rngs(key)), nnx.Param)

    out: dict[str, list] = {}
    for seed in range(SEEDS):
        for k, v in to_speculators(init(jax.random.key(seed))).items():
            out.setdefault(k, []).append(np.asarray(v, np.float64).ravel())
    return {k: np.concatenate(v) for k, v in out.items()}


def _pooled_reference(cfg) -> dict[str, np.ndarray]:
    from speculators.models.dspark import DSparkDraftModel as RefModel

    out: dict[str, list] = {}
    for seed in range(REF_SEEDS):
        torch.manual_seed(seed)
        model = RefModel(reference_config(cfg))
        for k, p in model.named_parameters():
            if p.requires_grad:
                out.setdefault(k, []).append(p.detach().double().numpy().ravel())
    return {k: np.concatenate(v) for k, v in out.items()}


@pytest.mark.parametrize(
    "kw",
    [
        dict(markov_head_type="vanilla"),
        dict(markov_head_type="gated"),
        dict(markov_head_type="rnn", confidence_head_with_markov=False),
    ],
    ids=["vanilla", "gated", "rnn-conf-without-markov"],
)
def test_initial_parameters_follow_the_reference_distributions(kw):
    cfg = base_config(**kw)
    ours, ref = _pooled_ours(cfg), _pooled_reference(cfg)
    assert set(ours) == set(ref)
    for key in sorted(ref):
        o, r = ours[key], ref[key]
        assert len(o) * REF_SEEDS == len(r) * SEEDS, key  # the same size per init
        if r.std() == 0:
            np.testing.assert_array_equal(o, r[: len(o)], err_msg=key)
            continue
        assert o.std() > 0, f"{key}: constant here, random in the reference"
        crit = _ks_critical(len(o), len(r))
        # x: the whole law; |x|: its scale, the most likely slip (a head drawn from HF's
        # N(0, 0.02) instead of torch's U(+-1/sqrt(fan_in))), with power left where x
        # alone has too few values (the one-element bias: 64 vs 128 values).
        for what, a, b in (("x", o, r), ("|x|", np.abs(o), np.abs(r))):
            ks = _ks(a, b)
            assert ks < crit, (
                f"{key}: KS({what}) {ks:.3f} >= {crit:.3f} (std {o.std():.4g} vs {r.std():.4g})"
            )
        # Uniform heads: the same support (+-1/sqrt(fan_in)) on both sides.
        assert np.abs(o).max() <= 1.0001 * max(np.abs(r).max(), 6 * r.std()), key


def test_confidence_head_init_is_torch_default_on_the_demo_shape():
    """The demo drafter's confidence head (H 192 + r 256 = 448 inputs): U(+-1/sqrt(448))."""
    cfg = base_config(hidden_size=192, markov_rank=256, intermediate_size=64)
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0))
    w = np.asarray(model.confidence_head.proj.kernel[...])
    b = np.asarray(model.confidence_head.proj.bias[...])
    bound = 1 / math.sqrt(448)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    # The sample std of n uniforms has relative standard error sqrt((kurtosis - 1) / 4n),
    # kurtosis 9/5: 2.1% for n = 448; 5 standard errors (false alarm < 1e-6).
    sigma, n = bound / math.sqrt(3), w.size
    tol = 5 * math.sqrt((9 / 5 - 1) / (4 * n)) * sigma
    assert abs(w.std() - sigma) < tol
    # ... which tells HF's N(0, 0.02) init (the likely slip) from torch's: 27% off.
    assert abs(0.02 - sigma) > tol
    assert b.item() != 0.0
