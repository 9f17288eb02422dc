"""The Grain pipeline: batch layout, exact resume, process sharding, bad-sample policy."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dspark_jax.data import files
from dspark_jax.data.files import BadSampleError, DataError, read_hidden_states
from dspark_jax.data.packing import RowBuffers
from dspark_jax.data.pipeline import (
    PackedData,
    ProcessRows,
    make_train_iterator,
    make_val_iterator,
)
from tests.data.conftest import make_tiny_data, write_hs
from tests.data.resume_child import digest

ROOT = Path(__file__).resolve().parents[2]
BF16 = np.dtype(ml_dtypes.bfloat16)


def _doc_index(d):
    """input_ids bytes -> document index, to recognise documents inside packed rows."""
    return {d.input_ids[i].astype(np.int32).tobytes(): i for i in range(len(d.input_ids))}


def _docs_in_row(batch, r, d):
    """(document index, tokens taken) of each document in row r of a batch."""
    index = _doc_index(d)
    out = []
    ids, docs = batch["input_ids"][r], batch["document_ids"][r]
    for k in range(int(docs.max()) + 1):
        toks = ids[docs == k]
        full = [
            i
            for i, x in enumerate(d.input_ids)
            if len(x) >= len(toks) and np.array_equal(x[: len(toks)], toks)
        ]
        hit = index.get(toks.tobytes())
        out.append((hit if hit is not None else full[0], len(toks)))
    return out


def test_batch_layout_and_values(tiny_data):
    d = tiny_data
    data = PackedData(d.data_path, **d.kwargs(rows_per_process=2))
    assert data.hidden_states_dtype == "bfloat16"
    it = data.train_iterator(num_epochs=1)
    batches = list(it)
    assert len(batches) == data.steps_per_epoch("train", 0) > 0
    S, H, K = d.total_seq_len, d.hidden_size, d.n_aux
    shapes = {
        "hidden_states": ((2, S, K * H), BF16),
        "verifier_last_hidden_states": ((2, S, H), BF16),
        "input_ids": ((2, S), np.int32),
        "loss_mask": ((2, S), np.int32),
        "position_ids": ((2, S), np.int32),
        "document_ids": ((2, S), np.int32),
        "error_records": ((2,), np.int32),
    }
    for b in batches:
        assert {k: (v.shape, v.dtype) for k, v in b.items()} == shapes
    # Rebuild every row by hand from the plan and the files written by the fixture.
    plan = data.plan("train", 0)
    for t, b in enumerate(batches):
        want = RowBuffers.allocate(2, S, K, H, BF16)
        for r in range(2):
            for doc in plan.row(t, r):
                want.append(r, d.input_ids[doc], d.loss_masks[doc], d.hidden[doc])
        for k, v in want.batch().items():
            np.testing.assert_array_equal(b[k].view(np.uint8), v.view(np.uint8), err_msg=k)
    # The over-long document 5 appears truncated to S when it is planned.
    assert (
        any(5 in plan.row(t, r) for t in range(plan.num_steps) for r in range(2))
        or 5 >= data.split_index
    )


def test_epochs_replan_and_iterator_reports_position(tiny_data):
    d = tiny_data
    data = PackedData(d.data_path, **d.kwargs(seed=3))
    it = data.train_iterator(num_epochs=2)
    n0, n1 = data.steps_per_epoch("train", 0), data.steps_per_epoch("train", 1)
    seen = []
    for b in it:
        seen.append((it.epoch, it.step))
    assert len(seen) == n0 + n1
    assert seen[n0 - 1] == (1, 0) and seen[-1] == (2, 0)
    assert data.plan("train", 0).digest() != data.plan("train", 1).digest()


def _resume_config(d, tmp_path, state, m, workers):
    cfg = {
        "data_path": str(d.data_path),
        "data": d.kwargs(rows_per_process=2, seed=7),
        "iterator": {"num_epochs": None, "num_workers": workers, "prefetch": 2},
        "state": state,
        "m": m,
    }
    p = tmp_path / "resume.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("workers,n,m", [(0, 7, 5), (2, 3, 4)])
def test_resume_in_new_process_is_exact(tiny_data, tmp_path, workers, n, m):
    d = tiny_data
    data = PackedData(d.data_path, **d.kwargs(rows_per_process=2, seed=7))
    assert data.steps_per_epoch("train", 0) < n + m or workers  # (0 workers: crosses an epoch)
    it = data.train_iterator(num_workers=workers, prefetch=2)
    for _ in range(n):
        next(it)
    state = it.get_state()
    json.dumps(state)  # JSON-able, as grain.checkpoint writes it
    expected = [digest(next(it)) for _ in range(m)]
    it.close()
    cfg = _resume_config(d, tmp_path, state, m, workers)
    out = subprocess.run(
        [sys.executable, "-m", "tests.data.resume_child", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == expected


@pytest.mark.parametrize("n", [0, 8, 9, 10])
def test_resume_at_and_around_epoch_boundary(tiny_data, n):
    d = tiny_data
    data = PackedData(d.data_path, **d.kwargs(rows_per_process=2))
    assert data.steps_per_epoch("train", 0) == 9
    it = data.train_iterator(num_epochs=3)
    ref = [digest(b) for b in it]
    it = data.train_iterator(num_epochs=3)
    for _ in range(n):
        next(it)
    state = it.get_state()
    it2 = data.train_iterator(num_epochs=3)
    it2.set_state(json.loads(json.dumps(state)))
    assert [digest(b) for b in it2] == ref[n:]


def test_resume_with_another_worker_count(tiny_data):
    d = tiny_data
    data = PackedData(d.data_path, **d.kwargs(rows_per_process=2))
    it = data.train_iterator()
    for _ in range(4):
        next(it)
    state = it.get_state()
    assert state == {"epoch": 0, "step": 4}
    expected = [digest(next(it)) for _ in range(3)]
    it2 = data.train_iterator(num_workers=1, prefetch=1)
    it2.set_state(state)
    assert [digest(next(it2)) for _ in range(3)] == expected
    it2.close()


def test_orbax_checkpoint_roundtrip(tiny_data, tmp_path):
    import grain
    import orbax.checkpoint as ocp

    d = tiny_data
    data = PackedData(d.data_path, **d.kwargs())
    it = data.train_iterator()
    for _ in range(5):
        next(it)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = [digest(next(it)) for _ in range(3)]
    it2 = data.train_iterator()
    mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it2)))
    assert [digest(next(it2)) for _ in range(3)] == expected
    mngr.close()


def test_two_processes_read_disjoint_shards_covering_the_split(tiny_data):
    d = tiny_data
    per_process = []
    for p in range(2):
        data = PackedData(d.data_path, **d.kwargs(process_index=p, process_count=2))
        batches = list(data.train_iterator(num_epochs=1))
        assert len(batches) == data.steps_per_epoch()  # both processes: same step count
        per_process.append(batches)
    assert len(per_process[0]) == len(per_process[1])
    docs = [{doc for b in bs for doc, _ in _docs_in_row(b, 0, d)} for bs in per_process]
    assert not docs[0] & docs[1]
    split = set(range(data.split_index))
    plan = data.plan("train", 0)
    dropped = split - set(plan.docs.tolist())
    assert len(dropped) < 2 and docs[0] | docs[1] == split - dropped
    # Same rows as one process feeding both ranks.
    one = PackedData(d.data_path, **d.kwargs(rows_per_process=2))
    for t, b in enumerate(one.train_iterator(num_epochs=1)):
        for p in range(2):
            for k in b:
                np.testing.assert_array_equal(
                    b[k][p : p + 1].view(np.uint8), per_process[p][t][k][0:1].view(np.uint8)
                )


@pytest.mark.parametrize("tokens", [(0, 24), (24, 64), (16, 48)])
def test_a_process_holding_part_of_each_row_reads_only_those_tokens(tiny_data, tokens, monkeypatch):
    """A context axis over processes: the process holding tokens [lo, hi) of its rows gets
    those tokens' hidden states (the whole-row batch's slice, bit for bit) and whole-row
    ids and masks, and reads from the files only the hidden-state rows of those tokens."""
    d = tiny_data
    lo, hi = tokens
    whole = list(
        PackedData(d.data_path, **d.kwargs(rows_per_process=2)).train_iterator(num_epochs=1)
    )
    views = []
    real_view = files.SafetensorsFile.view

    def recording(self, key, rows=None, start=0):
        out = real_view(self, key, rows, start)
        if key == "hidden_states":
            views.append(out.shape[0])
        return out

    monkeypatch.setattr(files.SafetensorsFile, "view", recording)
    rows = ProcessRows(range(0, 2), 2, tokens)
    part = list(PackedData(d.data_path, **d.kwargs(process_rows=rows)).train_iterator(num_epochs=1))
    assert len(part) == len(whole)
    for b, w in zip(part, whole, strict=True):
        for k, v in b.items():
            want = w[k][:, lo:hi] if k.endswith("hidden_states") else w[k]
            assert v.shape == want.shape, k
            np.testing.assert_array_equal(v.view(np.uint8), want.view(np.uint8), err_msg=k)
    # Rows read = the documents' tokens inside [lo, hi): nothing outside is touched.
    assert sum(views) == sum(int((w["document_ids"][:, lo:hi] >= 0).sum()) for w in whole)


def test_part_of_each_row_from_fp8_files_reads_those_rows_and_scales(tmp_path):
    """fp8 files are read with pread (rows and their scales from ``first_token``): the
    part equals the whole-row batch's slice after dequantisation."""
    d = make_tiny_data(tmp_path, fp8=True, n_docs=12)
    kw = d.kwargs(train_data_ratio=1.0)
    whole = list(PackedData(d.data_path, **kw).train_iterator(num_epochs=1))
    rows = ProcessRows((0,), 1, (16, 48))
    part = list(PackedData(d.data_path, **kw, process_rows=rows).train_iterator(num_epochs=1))
    assert len(part) == len(whole) > 0
    for b, w in zip(part, whole, strict=True):
        for k in ("hidden_states", "verifier_last_hidden_states"):
            assert b[k].dtype == np.float32
            np.testing.assert_array_equal(b[k], w[k][:, 16:48], err_msg=k)


def test_a_bad_sample_in_part_of_a_row_is_skipped_alike_or_stops(tiny_copy):
    """Missing or mismatched files (seen by every process) are skipped as without the split,
    so the processes sharing a row pack the same documents; non-finite values seen in one
    process's tokens cannot be skipped alike: that process stops, naming the file."""
    d = tiny_copy
    _break_some_files(d)
    write_hs(d.hs_path, 10, d.input_ids[10], d.hidden[10])  # repaired: no NaN yet
    kw = d.kwargs(on_missing="skip", rows_per_process=1)
    whole = list(PackedData(d.data_path, **kw).train_iterator(num_epochs=1))
    assert sum(int(b["error_records"].sum()) for b in whole) > 0
    for tokens in ((0, 32), (32, 64)):
        rows = ProcessRows(range(0, 1), 1, tokens)
        data = PackedData(d.data_path, **{**kw, "process_rows": rows})
        for b, w in zip(data.train_iterator(num_epochs=1), whole, strict=True):
            for k in ("input_ids", "loss_mask", "document_ids", "error_records"):
                np.testing.assert_array_equal(b[k], w[k], err_msg=k)
    h = d.hidden[10].copy()
    h[1, 0, 0] = np.nan
    write_hs(d.hs_path, 10, d.input_ids[10], h)
    stopped = []
    for tokens in ((0, 32), (32, 64)):
        rows = ProcessRows(range(0, 1), 1, tokens)
        data = PackedData(d.data_path, **{**kw, "process_rows": rows})
        try:
            list(data.train_iterator(num_epochs=1))
        except DataError as e:
            assert not isinstance(e, BadSampleError)
            assert "hs_10.safetensors" in str(e) and "cannot be skipped" in str(e)
            stopped.append(tokens)
    assert len(stopped) == 1  # the process that holds document 10's token 1


def test_validation_split_is_the_tail_with_a_fixed_seed(tiny_data):
    d = tiny_data
    a = PackedData(d.data_path, **d.kwargs(train_data_ratio=0.75, seed=1))
    b = PackedData(d.data_path, **d.kwargs(train_data_ratio=0.75, seed=2))
    assert a.split_range("val") == (36, 48)
    va, vb = list(a.val_iterator(epoch=0)), list(b.val_iterator(epoch=0))
    assert [digest(x) for x in va] == [digest(x) for x in vb]
    docs = {doc for x in va for doc, _ in _docs_in_row(x, 0, d)}
    assert docs and min(docs) >= 36
    assert a.plan("train", 0).digest() != b.plan("train", 0).digest()
    vit = make_val_iterator(
        d.data_path, train_data_ratio=0.75, epoch=1, **{k: v for k, v in d.kwargs().items()}
    )
    assert len(list(vit)) == a.steps_per_epoch("val", 1)
    with pytest.raises(Exception, match="validation split is empty"):
        PackedData(d.data_path, **d.kwargs(train_data_ratio=1.0)).val_iterator()
    with pytest.raises(
        Exception, match="validation split is too small: 1 of 48 rows .* fewer than the 2"
    ):
        PackedData(
            d.data_path, **d.kwargs(train_data_ratio=0.98, rows_per_process=2)
        ).val_iterator()
    with pytest.raises(Exception, match="train split is empty: 0 of 48"):
        PackedData(d.data_path, **d.kwargs(train_data_ratio=0.01))


def _break_some_files(d):
    """Corrupt three train documents in different ways; return their indices."""
    bad = [3, 10, 20]
    os.remove(d.hs_path / "hs_3.safetensors")
    h = d.hidden[10].copy()
    h[1, 0, 0] = np.nan
    write_hs(d.hs_path, 10, d.input_ids[10], h)
    ids = d.input_ids[20].copy()
    ids[0] += 1
    write_hs(d.hs_path, 20, ids, d.hidden[20])
    return bad


def test_skip_policy_counts_and_continues(tiny_copy, caplog):
    d = tiny_copy
    bad = _break_some_files(d)
    for policy in ("skip", "warn"):
        data = PackedData(d.data_path, **d.kwargs(on_missing=policy))
        planned = set(data.plan("train", 0).docs.tolist())
        with caplog.at_level(logging.WARNING, logger="dspark_jax.data.pipeline"):
            caplog.clear()
            batches = list(data.train_iterator(num_epochs=1))
        assert sum(int(b["error_records"].sum()) for b in batches) == len(planned & set(bad))
        seen = {doc for b in batches for doc, _ in _docs_in_row(b, 0, d)}
        assert not seen & set(bad)
        for b in batches:  # document ids stay consecutive after a skip
            ids = b["document_ids"][0]
            assert list(np.unique(ids[ids >= 0])) == list(range(int(ids.max()) + 1))
        warned = [r.getMessage() for r in caplog.records]
        summary = f"train epoch 0: skipped {len(planned & set(bad))} bad or missing samples"
        assert summary in warned[-1]  # both policies: an epoch summary in the log
        if policy == "warn":
            assert len(warned) == len(planned & set(bad)) + 1
            assert any("hs_10.safetensors" in w and "non-finite" in w for w in warned)
        else:
            assert len(warned) == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_raise_policy_stops_with_file_and_reason(tiny_copy, workers):
    d = tiny_copy
    _break_some_files(d)
    data = PackedData(d.data_path, **d.kwargs())
    it = data.train_iterator(num_epochs=1, num_workers=workers)
    with pytest.raises(
        Exception, match=r"hs_(3|10|20)\.safetensors \(dataset row (3|10|20)\)"
    ) as e:
        for _ in it:
            pass
    it.close()
    if workers == 0:
        assert isinstance(e.value, BadSampleError)


def test_fp8_files_give_float32_batches(tmp_path):
    d = make_tiny_data(tmp_path, fp8=True, n_docs=12)
    it = make_train_iterator(d.data_path, train_data_ratio=1.0, num_epochs=1, **d.kwargs())
    b = next(it)
    assert b["hidden_states"].dtype == np.float32
    data = PackedData(d.data_path, **d.kwargs(train_data_ratio=1.0))
    doc = int(data.plan("train", 0).row(0, 0)[0])
    hs = read_hidden_states(
        d.hs_path / f"hs_{doc}.safetensors",
        row=doc,
        input_ids=d.input_ids[doc],
        n_aux=d.n_aux,
        hidden_size=d.hidden_size,
        dtype=np.float32,
    )
    n = len(d.input_ids[doc])
    np.testing.assert_array_equal(b["verifier_last_hidden_states"][0, :n], hs.values[:n, -1])
    np.testing.assert_array_equal(b["hidden_states"][0, :n], hs.values[:n, :-1].reshape(n, -1))
    forced = PackedData(
        d.data_path, **d.kwargs(train_data_ratio=1.0, hidden_states_dtype="bfloat16")
    )
    assert next(forced.train_iterator())["hidden_states"].dtype == BF16


def test_bad_arguments_are_named(tiny_data):
    d = tiny_data
    with pytest.raises(ValueError, match="on_missing must be one of"):
        PackedData(d.data_path, **d.kwargs(on_missing="ignore"))
    with pytest.raises(ValueError, match="and an online source .* go together"):
        PackedData(d.data_path, **d.kwargs(on_missing="generate"))
    with pytest.raises(ValueError, match="train_data_ratio"):
        PackedData(d.data_path, **d.kwargs(train_data_ratio=0.0))
    with pytest.raises(ValueError, match="hidden_states_dtype"):
        PackedData(d.data_path, **d.kwargs(hidden_states_dtype="float64"))
    with pytest.raises(Exception, match="hidden states folder not found"):
        PackedData(d.data_path, d.data_path / "nope", **d.kwargs())


def test_to_global_arrays_on_simulated_devices(tiny_data):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dspark_jax.data.pipeline import to_global_arrays

    d = tiny_data
    n = jax.device_count()
    data = PackedData(d.data_path, **d.kwargs(rows_per_process=n, train_data_ratio=1.0))
    batch = next(data.train_iterator())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    arrays = to_global_arrays(batch, NamedSharding(mesh, P("data")))
    assert arrays.keys() == batch.keys()
    for k, v in batch.items():  # every array, bit for bit, one row per device
        assert arrays[k].dtype == v.dtype and arrays[k].shape == v.shape, k
        np.testing.assert_array_equal(np.asarray(arrays[k]).view(np.uint8), v.view(np.uint8))
        assert len(arrays[k].addressable_shards) == n, k
