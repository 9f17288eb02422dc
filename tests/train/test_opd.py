"""``--training-stage opd``: Draft-OPD in the step (dspark_jax/train/opd.py), on the
in-step verifier's tiny setup (tests/verifier/instep_fixtures.py: a random HF Qwen3 verifier,
hidden 8, 4 layers).

* The targets of a row's slots are the verifier's states on the *drafted* prefix: for
  each anchor, the document's tokens before it, then the tokens the slots condition on,
  run through the verifier's plain forward, agree with the step's targets slot by slot
  within the round-off bound of two fp32 forwards (tests/verifier/bounds.py), with and
  without sample_from_anchor (the two alignments of slots and positions).
* The drafted tokens are the drafter's own greedy tokens: each slot's argmax under the
  Markov head fed the drafted tokens is the token the next slot conditions on.
* The step's gradient equals a dense oracle's (the loss of docs/math.md written per slot,
  drafted tokens and targets held constant) within round-off; an oracle whose heads are fed
  the dataset's tokens instead is hundreds of bounds away.
* An SFT run continued with --training-stage opd trains, logs the Draft-OPD metrics and
  restarts its best validation loss; resuming it repeats it exactly.
"""

from __future__ import annotations

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import anchors as anchor_ops
from dspark_jax.model.draft import DSparkDraftModel, verifier_normed
from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train
from dspark_jax.train.opd import opd_row_loss, opd_row_values
from dspark_jax.verifier import hidden_states
from tests.numerics import DRAFTER_DEPTH, U
from tests.train.conftest import read_jsonl
from tests.verifier.bounds import chain_depth, pack_documents, projection_sensitivity
from tests.verifier.instep_fixtures import instep_argv

N = 4  # the verifier's layers
LENGTH = 128  # the packed row of the checked anchors' prefixes (3 x at most 30 + 4)


def opd_argv(instep_setup, out, **over):
    return instep_argv(instep_setup, out, **{"training_stage": "opd", **over})


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["sfa", "no_sfa"])
def test_targets_are_the_verifier_on_the_drafted_prefix(instep_setup, tmp_path, sample_from_anchor):
    over = {"sample_from_anchor" if sample_from_anchor else "no_sample_from_anchor": True}
    t = train.Trainer(
        cli.resolve(opd_argv(instep_setup, tmp_path, **over)), devices=jax.devices()[:1]
    )
    cfg = t.cfg
    assert cfg.sample_from_anchor is sample_from_anchor
    b, start = cfg.block_size, 0 if sample_from_anchor else 1
    batch = t.open_data().step_loader("train", 0)(0)
    vparams = t.instep.load(t.mesh)
    frozen = t.load_frozen()
    row = {
        k: v[0]
        for k, v in jax.jit(t.instep.fill)(vparams, jax.tree.map(jnp.asarray, batch)).items()
    }
    anchors, valid = anchor_ops.sample_anchors(
        jax.random.key(3), row["loss_mask"], row["document_ids"], 6, b, "per-row"
    )
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32, remat=False)
    # A Markov bias as large as the head's logits (at init it is ~1/100 of them), so that
    # conditioning on other tokens changes the argmaxes.
    w1 = model.markov_head.markov_w1.embedding
    w1[...] = jax.random.normal(jax.random.key(2), w1.shape) * 30.0
    maps = t.setup.vocab_maps
    d2t = None if maps is None else jnp.asarray(maps[0])
    r = jax.jit(
        lambda row, a, v: opd_row_values(
            model, frozen, t.instep, vparams, row, a, v, t.settings, jax.random.key(0), d2t
        )
    )(row, anchors, valid)
    prev, target = np.asarray(r.prev), np.asarray(r.target_hidden).reshape(len(anchors), b, -1)
    ids, doc = np.asarray(row["input_ids"]), np.asarray(row["document_ids"])
    anchors, valid = np.asarray(anchors), np.asarray(valid)

    # The drafter's own greedy tokens: slot k's argmax is what slot k + 1 conditions on.
    pred = np.asarray(r.values["pred_ids"]).reshape(len(anchors), b)
    if maps is not None:
        pred = pred + maps[0][pred]
    assert (prev[:, :start + 1] == np.asarray(
        anchor_ops.previous_tokens(row["input_ids"], jnp.asarray(anchors), b, sample_from_anchor)
    )[:, :start + 1]).all()  # fmt: skip
    assert (pred[:, start : b - 1] == prev[:, start + 1 :]).all()

    # One packed row holds each checked anchor's prefix as its own document: one forward,
    # one sensitivity computation for all of them.
    chosen = np.flatnonzero(valid)[:3]
    assert len(chosen) == 3
    m = b - start  # the block's slots with a target
    drafted, teacher = [], []
    for a in chosen:
        p = int(anchors[a])
        first = int(np.argmax(doc == doc[p]))
        drafted.append(np.concatenate([ids[first:p], prev[a, start:]]))
        teacher.append(ids[first : p + m])  # the dataset's own continuation
    seq, pos, docs, ends = pack_documents(drafted, LENGTH)
    run = jax.jit(lambda p, s, q, d: hidden_states(p, t.instep.cfg, s, q, d, (N,))[:, 0])
    want = np.asarray(run(vparams, seq, pos, docs))
    rows = np.concatenate([np.arange(e - m, e) for e in ends])
    got = target[chosen, start:].reshape(len(rows), -1)
    c = np.zeros((LENGTH, 1, got.shape[-1]), np.float32)
    c[rows, 0] = np.random.default_rng(0).standard_normal(got.shape)
    sens = projection_sensitivity(vparams, t.instep.cfg, seq, pos, docs, (N,), c)[rows, 0]
    bound = 2 * chain_depth(t.instep.cfg, N, LENGTH) * U * sens

    def within(x):
        return np.abs(np.einsum("jh,jh->j", c[rows, 0], x - got)) <= bound

    assert within(want[rows]).all()
    # Planted: the targets of the dataset's own continuations are not these.
    differs = np.concatenate(
        [np.any(d[-m:] != e[-m:]) * np.ones(m, bool) for d, e in zip(drafted, teacher, strict=True)]
    )
    assert differs.any()
    other = np.asarray(run(vparams, *pack_documents(teacher, LENGTH)[:3]))
    assert not within(other[rows])[differs].all()

    _check_gradient(model, frozen, t, vparams, row, jnp.asarray(anchors), jnp.asarray(valid), r)


def _oracle_slot_terms(model, frozen, cfg, settings, row, anchors, valid, prev, target_hidden):
    """The Draft-OPD loss of docs/math.md written densely, per slot: [Q] terms that sum to
    the row's loss, the drafted tokens ``prev`` and the targets ``target_hidden`` held as
    constants (no gradient can reach the drafting or the verifier), the Markov and
    confidence heads fed ``prev``. Each slot's normalisers are constants given the argmaxes."""
    b, sfa = cfg.block_size, cfg.sample_from_anchor
    num, hi = anchors.shape[0], jax.lax.Precision.HIGHEST
    hidden = model(row, anchors, frozen).hidden  # [Q, H]
    emb = model.markov_head.prev_embeddings(prev)
    feature = model.markov_head.features(emb, hidden.reshape(num, b, -1)).reshape(num * b, -1)
    zq = jnp.dot(hidden, frozen.lm_head, precision=hi)
    zq = zq + jnp.dot(feature, model.markov_w2(), precision=hi)
    target = verifier_normed(target_hidden, frozen, cfg, jnp.float32)
    zp = jnp.dot(target, frozen.verifier_lm_head.astype(jnp.float32), precision=hi)
    lq, lp = jax.nn.log_softmax(zq), jax.nn.log_softmax(zp)
    q, p = jnp.exp(lq), jnp.exp(lp)
    fkl, rkl = jnp.sum(p * (lp - lq), -1), jnp.sum(q * (lq - lp), -1)
    accept = jax.lax.stop_gradient(jnp.sum(jnp.minimum(p, q), -1))
    pos = jnp.arange(num * b) % b
    match = (jnp.argmax(zq, -1) == jnp.argmax(zp, -1)).reshape(num, b)
    match = match | (jnp.arange(b) < (0 if sfa else 1))
    acc_mask = jnp.cumprod(match.astype(jnp.float32), -1).reshape(-1)
    mask = anchor_ops.slot_loss_mask(row["loss_mask"], anchors, valid, b, sfa).astype(jnp.float32)
    accepted, rejected = acc_mask * mask, (1 - acc_mask) * mask
    decay = settings.gamma_opd ** pos.astype(jnp.float32)
    la, lr = settings.lambda_acc, settings.lambda_rej
    terms = la * fkl * accepted / jnp.maximum(accepted.sum(), 1e-5)
    terms += lr * rkl * rejected * decay / jnp.maximum((rejected * decay).sum(), 1e-5)
    terms /= la + lr
    feats = jnp.concatenate([hidden.reshape(num, b, -1), emb], -1)
    conf = model.confidence_head(feats).reshape(-1)
    bce = jnp.maximum(conf, 0) - conf * accept + jnp.log1p(jnp.exp(-jnp.abs(conf)))
    weight = jnp.exp(-pos / settings.gamma) if sfa else (
        jnp.exp(-jnp.maximum(pos - 1.0, 0) / settings.gamma) * (pos != 0))  # fmt: skip
    return terms + settings.confidence_head_alpha * bce * mask * weight / (mask.sum() + 1e-8)


def _check_gradient(model, frozen, t, vparams, row, anchors, valid, r):
    """The step's Draft-OPD gradient (opd_row_values -> opd_row_loss) equals the dense
    oracle's. Both sum the same per-slot terms in other orders: per leaf, within
    2 depth u of the slots' absolute gradients (tests/parallel/test_context.py's bound;
    depth: the drafter's chain, tests.numerics.DRAFTER_DEPTH, plus the vocabulary sums).
    Planted: the Markov and confidence heads fed the dataset's tokens instead."""
    cfg, settings = t.cfg, t.settings
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.markov_head_type == "vanilla" and cfg.verifier_logit_softcapping is None
    maps = t.setup.vocab_maps
    d2t = None if maps is None else jnp.asarray(maps[0])
    graphdef, params = nnx.split(model, nnx.Param)
    prev, target = jnp.asarray(r.prev), jnp.asarray(r.target_hidden)

    def step_loss(p):
        m = nnx.merge(graphdef, p)
        v = opd_row_values(m, frozen, t.instep, vparams, row, anchors, valid, settings,
                           jax.random.key(0), d2t)  # fmt: skip
        return opd_row_loss(v, cfg, settings)[0]

    def oracle(p, prev):
        m = nnx.merge(graphdef, p)
        return _oracle_slot_terms(m, frozen, cfg, settings, row, anchors, valid, prev, target)

    loss, got = jax.jit(jax.value_and_grad(step_loss))(params)
    total, want = jax.jit(jax.value_and_grad(lambda p: oracle(p, prev).sum()))(params)
    per_slot = jax.jit(jax.jacrev(oracle))(params, prev)
    depth = DRAFTER_DEPTH + 2 * frozen.lm_head.shape[-1]
    teacher = anchor_ops.previous_tokens(row["input_ids"], anchors, cfg.block_size,
                                         cfg.sample_from_anchor)  # fmt: skip
    assert (np.asarray(teacher) != np.asarray(prev)).any()
    planted = jax.jit(jax.grad(lambda p: oracle(p, teacher).sum()))(params)
    terms = np.abs(np.asarray(jax.jit(oracle)(params, prev), np.float64))
    assert abs(float(loss) - float(total)) <= 2 * depth * U * terms.sum()
    caught = []
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(got)]
    leaves = (jax.tree.leaves(x) for x in (got, want, per_slot, planted))
    for path, a, b, slots, bad in zip(paths, *leaves, strict=True):
        a, b, bad = (np.asarray(x, np.float64) for x in (a, b, bad))
        bound = 2 * depth * U * np.linalg.norm(np.abs(np.asarray(slots, np.float64)).sum(0))
        assert np.linalg.norm(a - b) <= bound, (path, np.linalg.norm(a - b), bound)
        caught.append(np.linalg.norm(bad - b) > bound)
    assert any(caught), "feeding the heads the dataset's tokens changed no gradient"


def test_sft_then_opd_trains_and_resumes_exactly(instep_setup, instep_trained, tmp_path, caplog):
    """The recipe: a 2-epoch SFT run's epoch-1 checkpoint (the session's in-step run)
    resumed with --training-stage opd for epoch 2 (checkpoints every half epoch); resuming
    that from its middle checkpoint repeats it exactly. The best validation loss restarts
    with the new objective."""
    sft = read_jsonl(instep_trained / "logs" / "run" / "metrics.jsonl")
    assert not any("opd_acc_loss" in r.get("train", {}) for r in sft)  # SFT logs no OPD metric
    assert all("opd_rej_loss_epoch" not in r["val"] for r in sft if "val" in r)
    full = tmp_path / "full"
    shutil.copytree(instep_trained / "ckpt", full / "ckpt")
    first = sorted(int(p.name) for p in (full / "ckpt").iterdir() if p.name.isdigit())
    assert len(first) == 2  # one per epoch: drop epoch 2's
    shutil.rmtree(full / "ckpt" / str(first[-1]))
    flags = dict(epochs=2, checkpoint_freq=0.5)
    with caplog.at_level(logging.INFO, logger="dspark_jax"):
        args = cli.resolve(opd_argv(instep_setup, full, **flags))
        assert train.run(args, devices=jax.devices()[:1]) == 0
    assert "checkpoint with --training-stage opd: the best validation loss restarts" in caplog.text
    records = read_jsonl(full / "logs" / "run" / "metrics.jsonl")
    opd = [r["train"] for r in records if "train" in r]
    assert opd and all("opd_acc_loss" in r for r in opd)
    for name in ("loss", "opd_acc_loss", "opd_rej_loss", "opd_accepted", "accept_len"):
        assert all(np.isfinite(r[name]) for r in opd), name
    vals = [r["val"] for r in records if "val" in r]
    assert np.isfinite(vals[-1]["opd_rej_loss_epoch"])
    steps = sorted(int(p.name) for p in (full / "ckpt").iterdir() if p.name.isdigit())
    meta = json.loads((full / "ckpt" / str(steps[-1]) / "meta" / "metadata").read_text())
    assert meta["training_stage"] == "opd" and steps[-1] == first[-1]  # epoch 2's end again
    assert meta["best_val_loss"] == pytest.approx(vals[-1]["loss_epoch"], rel=1e-6)

    shutil.copytree(full / "ckpt", tmp_path / "resumed" / "ckpt")
    shutil.rmtree(tmp_path / "resumed" / "ckpt" / str(steps[-1]))
    resumed = cli.resolve(opd_argv(instep_setup, tmp_path / "resumed", **flags))
    assert train.run(resumed, devices=jax.devices()[:1]) == 0
    losses = [r["loss"] for r in opd]
    again = [
        r["train"]["loss"]
        for r in read_jsonl(tmp_path / "resumed" / "logs" / "run" / "metrics.jsonl")
        if "train" in r
    ]
    assert again == losses[len(losses) - len(again) :] and 0 < len(again) < len(losses)


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(hidden_states_backend="file", verifier_dtype=None),
         "--training-stage opd needs --hidden-states-backend jax"),
        (dict(gamma_opd=0.0), "--gamma-opd must be in \\(0, 1\\], got 0.0"),
        (dict(lambda_acc=0.0, lambda_rej=0.0), "--lambda-acc 0.0 and --lambda-rej 0.0 must be"),
        (dict(training_stage="sft", lambda_rej=2.0), "--lambda-rej only apply with --training-stage opd"),
    ],
)  # fmt: skip
def test_flag_errors(instep_setup, tmp_path, over, message):
    with pytest.raises(cli.ConfigError, match=message):
        cli.resolve(opd_argv(instep_setup, tmp_path, **over))


def test_a_context_axis_is_refused(instep_setup, tmp_path):
    args = cli.resolve(opd_argv(instep_setup, tmp_path, mesh="context=2", rows_per_step=1))
    with pytest.raises(cli.ConfigError, match="--training-stage opd with --mesh context=2"):
        train.Trainer(args, devices=jax.devices()[:2])


def test_compile_for_a_sharded_mesh(instep_setup, tmp_path, capsys):
    """--dry-run --compile-for local --mesh fsdp=2,tensor=2 --training-stage opd, from the
    verifier's config.json alone (no weights, no data): the Draft-OPD step partitions, and
    its report counts the in-step verifier and its second pass (the row again and its
    drafted blocks). It stands for the plain in-step step's compile too: it holds the same
    verifier forward."""
    cfg_only = tmp_path / "config_only"
    cfg_only.mkdir()
    shutil.copy(instep_setup[0] / "verifier" / "config.json", cfg_only / "config.json")
    from tests.train.test_compile_for import tiny_compile_argv

    argv = tiny_compile_argv(
        cfg_only, tmp_path, "--compile-for", "local", "--mesh", "fsdp=2,tensor=2",
        "--hidden-states-backend", "jax", "--rows-per-step", "2", "--training-stage", "opd",
    )  # fmt: skip
    args = cli.resolve(argv)
    assert train.run(args, devices=jax.devices()[:4]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "in-step verifier (qwen3, 4 layers" in ln)
    assert "forward and on the drafted blocks (Draft-OPD) <= " in line
    assert "bfloat16 weights" in line and "TFLOP per step" in line
    assert out.splitlines()[-1].startswith("[compile] fits: local")


def test_free_running_tokens_greedy_and_sampled():
    """Without a Markov head: greedy slot k drafts argmax(h_k W), the token slot k + 1
    conditions on; sampled draws follow softmax(h_k W) (counts over 4000 blocks within 6
    binomial standard deviations), the same key draws the same tokens, another key others."""
    from dspark_jax.train.opd import free_running_tokens

    rng = np.random.default_rng(0)
    A, B, H, V = 4000, 3, 4, 5
    w = jnp.asarray(rng.standard_normal((H, V)), jnp.float32)
    h_row = rng.standard_normal((B, H)).astype(np.float32)
    hidden = jnp.asarray(np.broadcast_to(h_row, (A, B, H)))
    teacher = jnp.asarray(rng.integers(0, V, (A, B)), jnp.int32)

    def draft(key, sampled):
        return np.asarray(
            free_running_tokens(
                None, hidden, teacher, w, d2t=None, start_pos=0, key=key, sampled=sampled,
                anchor_chunk=512,
            )
        )  # fmt: skip

    greedy = draft(jax.random.key(0), False)
    z = h_row @ np.asarray(w)
    assert (greedy[:, 0] == np.asarray(teacher)[:, 0]).all()
    assert (greedy[:, 1:] == z[:-1].argmax(-1)[None]).all()
    drawn = draft(jax.random.key(1), True)
    assert (draft(jax.random.key(1), True) == drawn).all()
    assert (draft(jax.random.key(2), True) != drawn).any()
    p = np.exp(z[0] - z[0].max())
    p /= p.sum()
    counts = np.bincount(drawn[:, 1], minlength=V)
    assert (np.abs(counts - A * p) <= 6 * np.sqrt(A * p * (1 - p)) + 1).all(), (counts, A * p)
