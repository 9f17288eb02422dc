"""experts.dispatch (the MoE block's routed experts) on one device and expert parallel on
8 simulated devices: every token copy reaches its expert and comes back to its token.

The experts here are affine maps (x W_e + b_e: the bias, read by each row's expert id,
checks that a received copy is run by the expert it was sent to), against a float64
oracle per token. Each output is a sum of k weighted affine maps of H-term dot products
in fp32: |error| <= (H + k + 2) U sum_j |w_j| (|x| |W_ij| + |b_ij|) (H + 1 roundings in a
dot plus bias, one per weight, k - 1 in the sum, whatever the order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax.verifier.experts as experts
from dspark_jax import parallel
from tests.numerics import U

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

E, H, K = 8, 8, 2
ROWS, TOKENS = 3, 10  # 30 tokens: padded to whole chunks on 8 devices


def _affine(weights, xs, sizes, expert):
    y = jax.lax.ragged_dot(xs, weights["w"], sizes, preferred_element_type=jnp.float32)
    return y + weights["b"][expert]


def _case(skewed: bool):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, TOKENS, H)).astype(np.float32)
    if skewed:  # every copy to experts 0 and 1: one device of fsdp=4 gets them all
        top_i = np.broadcast_to(np.array([1, 0], np.int32), (ROWS, TOKENS, K)).copy()
    else:
        top_i = np.stack([rng.permutation(E)[:K] for _ in range(ROWS * TOKENS)])
        top_i = top_i.reshape(ROWS, TOKENS, K).astype(np.int32)
    top_w = rng.uniform(0.1, 1.0, (ROWS, TOKENS, K)).astype(np.float32)
    weights = {
        "w": rng.standard_normal((E, H, H)).astype(np.float32),
        "b": rng.standard_normal((E, H)).astype(np.float32),
    }
    return x, top_w, top_i, weights


def _oracle(x, top_w, top_i, weights):
    w64 = {n: a.astype(np.float64) for n, a in weights.items()}
    x64 = x.astype(np.float64)
    y = np.zeros(x.shape, np.float64)
    bound = np.zeros(x.shape, np.float64)
    for j in range(K):
        wj, ij = top_w[..., j, None].astype(np.float64), top_i[..., j]
        y += wj * (np.einsum("...h,...ho->...o", x64, w64["w"][ij]) + w64["b"][ij])
        mag = np.einsum("...h,...ho->...o", np.abs(x64), np.abs(w64["w"][ij]))
        bound += wj * (mag + np.abs(w64["b"][ij]))
    return y, (H + K + 2) * U * bound


def _dispatch(mesh_spec, x, top_w, top_i, weights, *, batched, exchange_rows):
    def f(x, top_w, top_i, weights):
        def one(x, top_w, top_i):
            return experts.dispatch(
                x, top_w, top_i, weights, compute=_affine, num_experts=E,
                exchange_rows=exchange_rows,
            )  # fmt: skip

        if batched:  # rows vmapped, as batch_hidden_states maps them
            return jax.vmap(one)(x, top_w, top_i)
        h = x.shape[-1]
        return one(x.reshape(-1, h), top_w.reshape(-1, K), top_i.reshape(-1, K)).reshape(x.shape)

    if mesh_spec is None:
        return np.asarray(jax.jit(f)(x, top_w, top_i, weights))
    mesh = parallel.make_mesh(mesh_spec)
    with jax.set_mesh(mesh):  # the step's arguments live on its mesh
        return np.asarray(jax.jit(f)(x, top_w, top_i, weights))


@pytest.mark.parametrize(
    "mesh, skewed, batched, exchange_rows",
    [
        (None, False, True, experts.EXCHANGE_ROWS),  # every expert local
        ("fsdp=4,tensor=2", False, True, 16),  # chunks of 2 tokens: 2 exchanges per device
        ("fsdp=4,tensor=2", True, False, 16),  # the worst case fills one device's buffer
        ("data=2,fsdp=4", False, False, experts.EXCHANGE_ROWS),  # one chunk, two groups
        ("fsdp=8", True, True, experts.EXCHANGE_ROWS),  # one expert per device
    ],
)
def test_dispatch_equals_the_oracle(mesh, skewed, batched, exchange_rows, monkeypatch):
    chunks = []
    real = experts._exchange
    monkeypatch.setattr(experts, "_exchange", lambda *a: chunks.append(1) or real(*a))
    x, top_w, top_i, weights = _case(skewed)
    y = _dispatch(mesh, x, top_w, top_i, weights, batched=batched, exchange_rows=exchange_rows)
    want, bound = _oracle(x, top_w, top_i, weights)
    assert np.all(np.abs(y - want) <= bound), np.max(np.abs(y - want) / bound)
    assert bool(chunks) == (mesh is not None)  # expert parallel under every mesh here


def test_experts_the_fsdp_axis_cannot_split_stay_whole():
    """6 experts on fsdp=4: replicated or split by width (parallel._fit), never expert
    parallel; the dispatch is the local one under the partitioner."""
    mesh = parallel.make_mesh("fsdp=4,tensor=2")
    with parallel.tracing_mesh(mesh):
        assert parallel.expert_parallel_size(6) == 1
        assert parallel.expert_parallel_size(8) == 4
    assert parallel.expert_parallel_size(8) == 1  # no mesh
