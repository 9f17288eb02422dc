"""Small on-disk fixtures in the exact layouts the PyTorch/vLLM side writes.

* ``write_prepared_dataset``: a HuggingFace ``save_to_disk`` folder (state.json,
  dataset_info.json, Arrow IPC stream shards) written with pyarrow alone.
* ``write_safetensors``: a byte-exact safetensors writer (bf16 / fp8 via ml_dtypes,
  which ``safetensors.numpy`` cannot write).
* ``write_hs``: one ``hs_{i}.safetensors`` ([T, n_aux+1, H] + token_ids, or fp8 +
  per-token scales).
* ``tiny_data``: 48 documents, H=8, n_aux=2, S=64, bf16: the data most tests use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

ST_NAMES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
}


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata=None) -> None:
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[name] = {
            "dtype": ST_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [off, off + arr.nbytes],
        }
        blobs.append(arr.tobytes())
        off += arr.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.writelines(blobs)


def write_prepared_dataset(
    path,
    input_ids,
    loss_masks,
    *,
    shards=1,
    list_type=None,
    columns=("input_ids", "loss_mask", "seq_len"),
    seq_lens=None,
) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    list_type = list_type or pa.list_(pa.int64())
    cols = {
        "input_ids": pa.array([list(map(int, x)) for x in input_ids], list_type),
        "loss_mask": pa.array([list(map(int, x)) for x in loss_masks], list_type),
        "seq_len": pa.array(
            seq_lens if seq_lens is not None else [len(x) for x in input_ids], pa.int64()
        ),
    }
    table = pa.table({c: cols[c] for c in columns})
    n = len(input_ids)
    bounds = np.linspace(0, n, shards + 1).astype(int)
    files = []
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        part = table.slice(bounds[k], bounds[k + 1] - bounds[k])
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
            for batch in part.to_batches(max_chunksize=7):  # several record batches
                w.write_batch(batch)
        files.append({"filename": name})
    (path / "state.json").write_text(
        json.dumps(
            {
                "_data_files": files,
                "_fingerprint": "0",
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": "torch",
                "_output_all_columns": False,
                "_split": None,
            }
        )
    )
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path


def fp8_quantize(hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """hs_connectors.fp8_utils.quantize_tensor_to_fp8 in numpy: per-token amax scale."""
    x = hidden.astype(np.float32)
    amax = np.abs(x).max(axis=(1, 2), keepdims=True)
    scale = np.maximum(amax / 448.0, 1e-12).astype(np.float32)
    return (x / scale).astype(ml_dtypes.float8_e4m3fn), scale


def write_hs(hs_dir, idx, token_ids, hidden, *, fp8=False) -> Path:
    path = Path(hs_dir) / f"hs_{idx}.safetensors"
    tensors = {"token_ids": np.asarray(token_ids, np.int64)}
    if fp8:
        q, scale = fp8_quantize(hidden)
        tensors["hidden_states"], tensors["hidden_states_scales"] = q, scale
    else:
        tensors["hidden_states"] = hidden
    write_safetensors(path, tensors, {"format": "pt"})
    return path


@dataclass
class TinyData:
    data_path: Path
    hs_path: Path
    input_ids: list[np.ndarray]
    loss_masks: list[np.ndarray]
    hidden: list[np.ndarray]  # [T, n_aux+1, H] as written (bf16)
    n_aux: int
    hidden_size: int
    total_seq_len: int

    def kwargs(self, **over):
        kw = {
            "total_seq_len": self.total_seq_len,
            "n_aux": self.n_aux,
            "hidden_size": self.hidden_size,
            "process_index": 0,
            "process_count": 1,
        }
        kw.update(over)
        return kw


def make_tiny_data(
    root,
    *,
    n_docs=48,
    n_aux=2,
    hidden_size=8,
    total_seq_len=64,
    seed=0,
    fp8=False,
    max_len=40,
    shards=2,
) -> TinyData:
    rng = np.random.default_rng(seed)
    root = Path(root)
    data_path = root / "prepared"
    hs = data_path / "hidden_states"
    lengths = rng.integers(3, max_len + 1, n_docs)
    lengths[5] = total_seq_len + 9  # one document longer than a row: truncated
    ids, masks, hidden = [], [], []
    for i, n in enumerate(lengths):
        ids.append(rng.integers(0, 1000, n))
        m = (rng.random(n) < 0.7).astype(np.int64)
        m[0] = 0
        masks.append(m)
        hidden.append(rng.standard_normal((n, n_aux + 1, hidden_size)).astype(ml_dtypes.bfloat16))
    write_prepared_dataset(data_path, ids, masks, shards=shards)
    hs.mkdir()
    for i in range(n_docs):
        write_hs(hs, i, ids[i], hidden[i], fp8=fp8)
    return TinyData(data_path, hs, ids, masks, hidden, n_aux, hidden_size, total_seq_len)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    return make_tiny_data(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def tiny_copy(tmp_path) -> TinyData:
    """A private copy for tests that corrupt files."""
    return make_tiny_data(tmp_path)
