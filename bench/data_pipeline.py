"""Throughput of the hidden-state data pipeline (dspark_jax.data) on this machine.

Writes a synthetic prepared dataset + ``hs_{i}.safetensors`` files (bf16, n_aux+1
slots of H, document lengths log-normal around ``--mean-len``) into a scratch
folder, then measures:

* ``raw_read``: ``read_hidden_states`` over every file, one thread (the reader's
  ceiling: header checks, token check, pread, finite check);
* ``pipeline``: one epoch of ``PackedData.train_iterator`` for each worker count,
  timed from the first batch (worker start-up reported separately as
  ``first_batch_s``), i.e. reading, validating and packing rows of S tokens.

``samples/s`` counts documents, ``GB/s`` the hidden-state bytes read from the files
(tokens actually packed x (n_aux+1) x H x itemsize, + token_ids). The files were
just written, so they are read from the page cache: this is the CPU cost of the
pipeline, not the disk's speed.

    python bench/data_pipeline.py [--docs 96] [--hidden 1024] [--n-aux 3] \
        [--seq-len 4096] [--mean-len 1024] [--workers 0 2] [--rows 1] [--dir DIR]

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa

from dspark_jax.data.files import read_hidden_states
from dspark_jax.data.pipeline import PackedData

BF16 = np.dtype(ml_dtypes.bfloat16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    names = {BF16: "BF16", np.dtype(np.int64): "I64"}
    header, off = {}, 0
    for k, v in tensors.items():
        header[k] = {
            "dtype": names[v.dtype],
            "shape": list(v.shape),
            "data_offsets": [off, off + v.nbytes],
        }
        off += v.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for v in tensors.values():
            f.write(np.ascontiguousarray(v).tobytes())


def make_data(root: Path, docs: int, hidden: int, n_aux: int, mean_len: int, seq_len: int):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(mean_len), 0.6, docs).astype(int), 16, 2 * seq_len)
    ids = [rng.integers(0, 150_000, n) for n in lengths]
    data = root / "prepared"
    data.mkdir(parents=True)
    table = pa.table(
        {
            "input_ids": pa.array([x.tolist() for x in ids], pa.list_(pa.int64())),
            "loss_mask": pa.array([[1] * len(x) for x in ids], pa.list_(pa.int64())),
            "seq_len": pa.array(lengths.tolist(), pa.int64()),
        }
    )
    with (
        pa.OSFile(str(data / "data-00000-of-00001.arrow"), "wb") as s,
        pa.ipc.new_stream(s, table.schema) as w,
    ):
        w.write_table(table)
    (data / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    hs = data / "hidden_states"
    hs.mkdir()
    # One random block reused (cheap to generate); values do not affect the reader.
    block = rng.standard_normal((int(lengths.max()), n_aux + 1, hidden)).astype(BF16)
    for i, x in enumerate(ids):
        write_safetensors(
            hs / f"hs_{i}.safetensors",
            {"hidden_states": block[: len(x)], "token_ids": x.astype(np.int64)},
        )
    return data, lengths


def packed_bytes(data: PackedData, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step: (documents, hidden-state bytes) its rows read, mirroring StepLoader."""
    plan = data.plan("train", epoch)
    per_token = (data.n_aux + 1) * data.hidden_size * BF16.itemsize
    docs = np.zeros(plan.num_steps, np.int64)
    nbytes = np.zeros(plan.num_steps, np.int64)
    for t in range(plan.num_steps):
        for r in data.ranks:
            fill = 0
            for doc in plan.row(t, r):
                if fill == data.total_seq_len:
                    break
                n = int(data.dataset.seq_len[doc])
                take = min(n, data.total_seq_len - fill)
                fill += take
                docs[t] += 1
                nbytes[t] += take * per_token + n * 8
    return docs, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--n-aux", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--mean-len", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=1, help="rows per process (R)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--read-threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    args = ap.parse_args()

    from absl import flags

    flags.FLAGS.mark_as_parsed()
    root = args.dir or Path(tempfile.mkdtemp(prefix="dspark_bench_"))
    t0 = time.perf_counter()
    data_path, lengths = make_data(
        root / "d", args.docs, args.hidden, args.n_aux, args.mean_len, args.seq_len
    )
    on_disk = sum(f.stat().st_size for f in (data_path / "hidden_states").iterdir())
    print(
        json.dumps(
            {
                "bench": "setup",
                "docs": args.docs,
                "hidden": args.hidden,
                "n_aux": args.n_aux,
                "seq_len": args.seq_len,
                "mean_doc_tokens": float(lengths.mean()),
                "hs_gb": on_disk / 1e9,
                "write_s": round(time.perf_counter() - t0, 2),
                "cpus": os.cpu_count(),
            }
        ),
        flush=True,
    )
    try:
        from dspark_jax.data.files import PreparedDataset

        ds = PreparedDataset(data_path)
        t0 = time.perf_counter()
        nbytes = 0
        for i in range(len(ds)):
            hs = read_hidden_states(
                data_path / "hidden_states" / f"hs_{i}.safetensors",
                row=i,
                input_ids=ds.input_ids(i),
                n_aux=args.n_aux,
                hidden_size=args.hidden,
                dtype=BF16,
            )
            nbytes += hs.nbytes_read
        dt = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "bench": "raw_read",
                    "threads": 1,
                    "samples_per_s": len(ds) / dt,
                    "gb_per_s": nbytes / dt / 1e9,
                }
            ),
            flush=True,
        )

        for workers in args.workers:
            data = PackedData(
                data_path,
                total_seq_len=args.seq_len,
                n_aux=args.n_aux,
                hidden_size=args.hidden,
                train_data_ratio=1.0,
                rows_per_process=args.rows,
                process_index=0,
                process_count=1,
            )
            docs, nbytes = packed_bytes(data, 0)
            steps = data.steps_per_epoch("train", 0)
            t0 = time.perf_counter()
            it = data.train_iterator(
                num_epochs=1, num_workers=workers, prefetch=4, read_threads=args.read_threads
            )
            next(it)
            t1 = time.perf_counter()
            n = 1 + sum(1 for _ in it)
            t2 = time.perf_counter()
            it.close()
            assert n == steps
            rest = max(t2 - t1, 1e-9)  # steps 1.. (step 0 includes worker start-up)
            print(
                json.dumps(
                    {
                        "bench": "pipeline",
                        "workers": workers,
                        "read_threads": args.read_threads,
                        "rows_per_step": args.rows,
                        "steps": steps,
                        "first_batch_s": round(t1 - t0, 3),
                        "steps_per_s": (steps - 1) / rest,
                        "samples_per_s": docs[1:].sum() / rest,
                        "tokens_per_s": (steps - 1) * args.rows * args.seq_len / rest,
                        "gb_per_s": nbytes[1:].sum() / rest / 1e9,
                    }
                ),
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
