"""Readers: prepared Arrow rows, safetensors, hidden-state files and their validation."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
from safetensors.numpy import save_file

from dspark_jax.data.files import (
    BadSampleError,
    DataError,
    PreparedDataset,
    SafetensorsFile,
    dequantize_fp8,
    read_hidden_states,
)
from tests.data.conftest import fp8_quantize, write_hs, write_prepared_dataset, write_safetensors
from tests.numerics import U, assert_within

BF16 = np.dtype(ml_dtypes.bfloat16)


def _rows(n=20, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 500, rng.integers(1, 30)) for _ in range(n)]
    masks = [(rng.random(len(x)) < 0.5).astype(np.int64) for x in ids]
    return ids, masks


@pytest.mark.parametrize(
    "list_type", [pa.list_(pa.int64()), pa.list_(pa.int32()), pa.large_list(pa.int64())]
)
def test_prepared_dataset_reads_rows_across_shards(tmp_path, list_type):
    ids, masks = _rows()
    write_prepared_dataset(tmp_path / "d", ids, masks, shards=3, list_type=list_type)
    ds = PreparedDataset(tmp_path / "d")
    assert len(ds) == len(ids)
    np.testing.assert_array_equal(ds.seq_len, [len(x) for x in ids])
    for i in range(len(ids)):
        np.testing.assert_array_equal(ds.input_ids(i), ids[i])
        np.testing.assert_array_equal(ds.loss_mask(i), masks[i])


def test_prepared_dataset_pickles_by_path(tmp_path):
    import pickle

    ids, masks = _rows(5)
    write_prepared_dataset(tmp_path / "d", ids, masks)
    ds = pickle.loads(pickle.dumps(PreparedDataset(tmp_path / "d")))
    np.testing.assert_array_equal(ds.input_ids(4), ids[4])


def test_missing_arrow_column_is_named(tmp_path):
    ids, masks = _rows(5)
    write_prepared_dataset(tmp_path / "d", ids, masks, columns=("input_ids", "seq_len"))
    with pytest.raises(
        DataError, match=r"no column\(s\) \['loss_mask'\].*columns: \['input_ids', 'seq_len'\]"
    ):
        PreparedDataset(tmp_path / "d")


def test_seq_len_disagreeing_with_input_ids_is_rejected(tmp_path):
    ids, masks = _rows(5)
    write_prepared_dataset(
        tmp_path / "d", ids, masks, seq_lens=[len(x) + (i == 3) for i, x in enumerate(ids)]
    )
    write_prepared_dataset(tmp_path / "e", ids, masks[:2] + [m[:-1] for m in masks[2:]])
    with pytest.raises(
        DataError, match="seq_len differs from len.input_ids. at 1 rows .first: row 3"
    ):
        PreparedDataset(tmp_path / "d")
    with pytest.raises(DataError, match="loss_mask and input_ids lengths differ"):
        PreparedDataset(tmp_path / "e")


def test_not_a_save_to_disk_folder(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no state.json"):
        PreparedDataset(tmp_path / "d")
    with pytest.raises(DataError, match="folder not found"):
        PreparedDataset(tmp_path / "nope")


def test_safetensors_reader_matches_safetensors_package(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((5, 3)).astype(np.float32),
        "b": np.arange(7, dtype=np.int64),
        "c": np.zeros((0, 4), np.float16),
        "d": rng.standard_normal((4, 2, 3)).astype(BF16),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))  # the package's own writer
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(f.keys()) == ["a", "b", "c", "d"]
    for k, v in tensors.items():
        got = f.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got.view(np.uint8), v.view(np.uint8))
    np.testing.assert_array_equal(
        f.read("d", rows=2).view(np.uint16), tensors["d"][:2].view(np.uint16)
    )


def test_read_hidden_states_bf16(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, 12)
    h = rng.standard_normal((12, 4, 8)).astype(BF16)
    p = write_hs(tmp_path, 3, ids, h)
    hs = read_hidden_states(p, row=3, input_ids=ids, n_aux=3, hidden_size=8, dtype=BF16)
    np.testing.assert_array_equal(hs.values.view(np.uint16), h.view(np.uint16))
    part = read_hidden_states(
        p, row=3, input_ids=ids, n_aux=3, hidden_size=8, dtype=BF16, max_tokens=5
    )
    assert part.values.shape == (5, 4, 8)
    np.testing.assert_array_equal(part.values.view(np.uint16), h[:5].view(np.uint16))
    as_f32 = read_hidden_states(p, row=3, input_ids=ids, n_aux=3, hidden_size=8, dtype=np.float32)
    np.testing.assert_array_equal(as_f32.values, h.astype(np.float32))


def test_read_hidden_states_fp8_dequantises(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, 6)
    h = (rng.standard_normal((6, 3, 8)) * 5).astype(np.float32)
    p = write_hs(tmp_path, 0, ids, h, fp8=True)
    q, scale = fp8_quantize(h)
    hs = read_hidden_states(p, row=0, input_ids=ids, n_aux=2, hidden_size=8, dtype=np.float32)
    np.testing.assert_array_equal(hs.values, q.astype(np.float32) * scale)
    # e4m3 keeps 4 significant bits: a normal value rounds within 2^-4 relative, a
    # subnormal one (below 2^-6, spacing 2^-9) within 2^-10 absolute, in units of the
    # token's scale; x / scale and q * scale are fp32 (2 u more).
    bound = (2.0**-4 + 2 * U) * np.abs(h) + 2.0**-10 * scale
    assert_within(hs.values, h, bound, "fp8 round trip")
    bf = read_hidden_states(p, row=0, input_ids=ids, n_aux=2, hidden_size=8, dtype=BF16)
    np.testing.assert_array_equal(
        bf.values.view(np.uint16), dequantize_fp8(q, scale, BF16).view(np.uint16)
    )


def _good(tmp_path, T=10, K=3, H=8):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 100, T)
    h = rng.standard_normal((T, K, H)).astype(BF16)
    return ids, h


def _corrupt(kind, tmp_path):
    """Write one bad hs_7 file; return (input_ids the dataset row holds, expected message)."""
    ids, h = _good(tmp_path)
    p = tmp_path / "hs_7.safetensors"
    if kind == "missing":
        return ids, "hidden states file not found"
    if kind == "truncated":
        write_hs(tmp_path, 7, ids, h)
        p.write_bytes(p.read_bytes()[:-40])
        return ids, "file is truncated"
    if kind == "garbage":
        p.write_bytes(b"\xff" * 64)
        return ids, "header length .* exceeds the file size"
    if kind == "wrong_key":
        write_safetensors(p, {"hidden_state": h, "token_ids": ids.astype(np.int64)})
        return ids, r"missing tensor 'hidden_states' \(found: \['hidden_state', 'token_ids'\]\)"
    if kind == "token_mismatch":
        bad = ids.copy()
        bad[4] += 1
        write_hs(tmp_path, 7, bad, h)
        return ids, f"token_ids differ .* position 4: sample has {bad[4]}, dataset has {ids[4]}"
    if kind == "token_count":
        write_hs(tmp_path, 7, ids[:-1], h[:-1])
        return ids, "token_ids has 9 tokens but the prepared dataset row has 10"
    if kind == "t_mismatch":
        write_hs(tmp_path, 7, ids, h[:-2])
        return ids, "hidden_states has T=8 tokens but token_ids has 10"
    if kind == "nan":
        h = h.copy()
        h[6, 1, 2] = np.nan
        write_hs(tmp_path, 7, ids, h)
        return ids, r"non-finite values \(first at token 6, slot 1\)"
    if kind == "inf_fp8_scale":
        write_hs(tmp_path, 7, ids, h.astype(np.float32), fp8=True)
        raw = bytearray(p.read_bytes())
        # Overwrite the last scale (float32, the last tensor in the file) with +inf.
        raw[-4:] = np.array([np.inf], np.float32).tobytes()
        p.write_bytes(bytes(raw))
        return ids, "non-finite values"
    if kind == "layer_count":
        write_hs(tmp_path, 7, ids, h[:, :2])
        return ids, "hidden_states has 2 layer slots, expected n_aux\\+1 = 3"
    if kind == "hidden_size":
        write_hs(tmp_path, 7, ids, h[:, :, :4])
        return ids, "hidden size 4, expected 8"
    if kind == "fp8_no_scales":
        write_safetensors(
            p,
            {"hidden_states": h.astype(ml_dtypes.float8_e4m3fn), "token_ids": ids.astype(np.int64)},
        )
        return ids, "F8_E4M3 hidden_states without 'hidden_states_scales'"
    if kind == "int_hidden":
        write_safetensors(
            p, {"hidden_states": h.astype(np.int32), "token_ids": ids.astype(np.int64)}
        )
        return ids, "dtype I32, expected a float"
    raise AssertionError(kind)


BAD_KINDS = [
    "missing",
    "truncated",
    "garbage",
    "wrong_key",
    "token_mismatch",
    "token_count",
    "t_mismatch",
    "nan",
    "inf_fp8_scale",
    "layer_count",
    "hidden_size",
    "fp8_no_scales",
    "int_hidden",
]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_each_bad_hidden_states_file_has_its_own_message(tmp_path, kind):
    ids, message = _corrupt(kind, tmp_path)
    with pytest.raises(BadSampleError, match=message) as e:
        read_hidden_states(
            tmp_path / "hs_7.safetensors", row=7, input_ids=ids, n_aux=2, hidden_size=8, dtype=BF16
        )
    assert e.value.row == 7 and e.value.path.endswith("hs_7.safetensors")
    assert "dataset row 7" in str(e.value)


def test_state_json_pointing_to_missing_shard(tmp_path):
    ids, masks = _rows(3)
    write_prepared_dataset(tmp_path / "d", ids, masks)
    state = json.loads((tmp_path / "d/state.json").read_text())
    state["_data_files"].append({"filename": "data-00001-of-00002.arrow"})
    (tmp_path / "d/state.json").write_text(json.dumps(state))
    with pytest.raises(
        DataError, match="lists shard data-00001-of-00002.arrow, which does not exist"
    ):
        PreparedDataset(tmp_path / "d")


def test_extraction_config_record_is_checked(tmp_path):
    from dspark_jax.data.files import check_extraction_config

    assert check_extraction_config(tmp_path, n_aux=2, hidden_size=8) is None
    rec = {"layer_ids": [2, 5, 12], "num_hidden_layers": 12, "hidden_size": 8, "dtype": "bfloat16"}
    (tmp_path / "extraction_config.json").write_text(json.dumps(rec))
    assert check_extraction_config(tmp_path, n_aux=2, hidden_size=8, aux_layer_ids=[2, 5]) == rec
    with pytest.raises(
        DataError, match="aux layers \\[2, 5\\], the draft config asks for \\[2, 6\\]"
    ):
        check_extraction_config(tmp_path, n_aux=2, hidden_size=8, aux_layer_ids=[2, 6])
    with pytest.raises(DataError, match="has 3 slots, expected n_aux\\+1 = 4"):
        check_extraction_config(tmp_path, n_aux=3, hidden_size=8)
    with pytest.raises(DataError, match="hidden_size 8, expected 16"):
        check_extraction_config(tmp_path, n_aux=2, hidden_size=16)
    rec["layer_ids"] = [2, 5, 11]
    (tmp_path / "extraction_config.json").write_text(json.dumps(rec))
    with pytest.raises(DataError, match="last slot holds layer 11, but .* last layer \\(12\\)"):
        check_extraction_config(tmp_path, n_aux=2, hidden_size=8)
