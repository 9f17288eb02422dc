"""Throughput of online hidden-state generation (``--on-missing generate``) as the
trainer's data process sees it: ours (dspark_jax.data) vs speculators 0.9.0's
``ArrowDataset``, against the same extractor server, on the same samples, in one run.

Setup (nothing of it is timed):

* a prepared dataset (``datasets.save_to_disk``, torch format, as speculators'
  preprocessing writes it) of ``--docs`` N documents of ``--tokens`` T random token
  ids, and no hidden-state files: every sample is generated online;
* the extractor: ``launch/serve_hidden_states.py``'s ``HiddenStatesServer`` in its own
  process (as a vLLM server is), with a synthetic extractor: the hidden states of a
  prompt are a slice of one cached random bf16 block ``[P, n_aux+1, H]`` at an offset
  given by the CRC32 of the prompt (deterministic, distinct per document, free to
  compute), after an artificial ``--extract-ms`` sleep per request that models the
  verifier's forward on a remote GPU. The sleep runs outside the server's forward
  lock, so concurrent requests overlap as they would in a batching vLLM (an ideal
  one: no batch gets slower as it grows);
* the transports: ``file`` (``FilePublisher``: safetensors files + ``.lock`` in a
  staging folder on local disk, written by a writer thread after the answer, as
  vLLM's ``ExampleHiddenStatesConnector``) and ``mooncake`` (``MooncakePublisher``,
  packed format = hs_connectors 0.9.0's, into a real ``mooncake_master`` started
  here on free ports; producer and consumers are separate store clients, TCP over
  loopback). If ``mooncake.store`` does not import (no libibverbs1), the Mooncake
  lines are skipped with a message: a fake store would not measure Mooncake.

Measured, per transport:

* ``jax``: one epoch of ``PackedData(on_missing="generate", online=OnlineSource(
  OnlineSettings(requests_in_flight=K), transport)).train_iterator(num_workers=0)``
  (one trainer data process: requests, transfer, validation, packing into rows of
  ``--seq-len`` S tokens, one row per step), for each K of ``--in-flight``;
* ``reference``: ``ArrowDataset(on_missing="generate", transfer=FileTransfer(staging)
  | MooncakeTransfer(store))[i]`` for every i in order, in this process: what one
  reference DataLoader worker does (one blocking round trip per sample through the
  openai client; the collate/packing step is not included).

``samples_per_s`` counts documents delivered, ``gb_per_s`` their hidden-state bytes
(T x (n_aux+1) x H x 2). ``max_concurrent_requests`` is what the server saw at once.
Before the timed runs one step of ours and two samples of the reference go
through untimed (lazy imports, server threads, connections, store segment pages). Correctness: the batches of the first and last
step of every ``jax`` run, and the reference's samples of the same documents, are
compared bit for bit with each other and with the extractor's tensors (``"check":
"ok"``, else the script exits with an error).

    python bench/online_pipeline.py [--docs 64] [--tokens 2048] [--hidden 1024] \
        [--n-aux 3] [--seq-len 4T] [--extract-ms 50] [--transports file mooncake] \
        [--in-flight 1 4 8] [--read-threads 1] [--prefetch 4] [--quick] [--dir DIR]

Prints one JSON line per (impl, transport, in_flight), then a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: launch/
from launch.mooncake_master import start_master  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SERVED = "bench-verifier"
POOL_SLACK = 4096  # rows of the random block beyond T: offsets to choose from
STATS_TAG = "bench_server"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


# ------------------------------------------------------------------------ extractor


def make_pool(tokens: int, n_aux: int, hidden: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    return rng.standard_normal((tokens + POOL_SLACK, n_aux + 1, hidden), np.float32).astype(BF16)


def pool_offset(ids, pool_len: int) -> int:
    arr = np.asarray(ids, np.int64)
    return zlib.crc32(arr.tobytes()) % (pool_len - len(arr) + 1)


def expected_states(pool: np.ndarray, ids) -> np.ndarray:
    off = pool_offset(ids, len(pool))
    return pool[off : off + len(ids)]


class SyntheticExtractor:
    """``extract([ids]) -> [bf16 tensor [T, n_aux+1, H]]``: a slice of the pool."""

    def __init__(self, tokens: int, n_aux: int, hidden: int, seed: int):
        import torch

        self.pool = torch.from_numpy(make_pool(tokens, n_aux, hidden, seed).view(np.int16)).view(
            torch.bfloat16
        )
        self.layer_ids = list(range(n_aux + 1))
        self.model_name = SERVED

    def extract(self, rows):
        out = []
        for r in rows:
            off = pool_offset(r, self.pool.shape[0])
            out.append(self.pool[off : off + len(r)])
        return out


def bench_server_class():
    from launch.serve_hidden_states import HiddenStatesServer

    class BenchServer(HiddenStatesServer):
        """The real server; ``forward`` first sleeps ``extract_s`` outside the forward
        lock (requests overlap: a batching GPU server); counts concurrent requests."""

        def __init__(self, extractor, publisher, extract_ms: float):
            super().__init__(extractor, SERVED, publisher)
            self.extract_s = extract_ms / 1000.0
            self._stats_lock = threading.Lock()
            self.active = self.max_active = self.requests = 0

        def forward(self, prompt):
            if self.extract_s:
                time.sleep(self.extract_s)
            return super().forward(prompt)

        def complete(self, body):
            with self._stats_lock:
                self.active += 1
                self.requests += 1
                self.max_active = max(self.max_active, self.active)
            try:
                return super().complete(body)
            finally:
                with self._stats_lock:
                    self.active -= 1

        def take_stats(self) -> dict:
            with self._stats_lock:
                out = {"requests": self.requests, "max_concurrent_requests": self.max_active}
                self.requests = self.max_active = 0
            return out

    return BenchServer


def build_publisher(cfg: dict, store=None):
    from launch.serve_hidden_states import FilePublisher, MooncakePublisher

    if cfg["transport"] == "file":
        return FilePublisher(cfg["staging"])
    from dspark_jax.data.online.mooncake import MooncakeConfig, MooncakeHiddenStates, open_store

    if store is None:
        store = open_store(
            MooncakeConfig(
                local_hostname="127.0.0.1",
                master_server_address=cfg["master"],
                global_segment_size=cfg["segment_bytes"],
                local_buffer_size=64 << 20,
            )
        )
    return MooncakePublisher(MooncakeHiddenStates(store), "packed")


def build_server(cfg: dict, store=None):
    extractor = SyntheticExtractor(cfg["tokens"], cfg["n_aux"], cfg["hidden"], cfg["seed"])
    return bench_server_class()(extractor, build_publisher(cfg, store), cfg["extract_ms"])


def serve_main(cfg: dict) -> None:
    """The server process: prints its URL, answers ``stats`` lines on stdin, stops at EOF."""
    server = build_server(cfg).start()
    print(json.dumps({STATS_TAG: True, "base_url": server.base_url}), flush=True)
    try:
        for line in sys.stdin:
            if line.strip() == "stats":
                print(json.dumps({STATS_TAG: True, **server.take_stats()}), flush=True)
    finally:
        server.stop()


class ServerProcess:
    def __init__(self, cfg: dict):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.base_url = self._reply()["base_url"]

    def _reply(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the extractor server exited (status {self.proc.wait()})")
            if line.startswith("{") and STATS_TAG in line:
                return json.loads(line)

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        out = self._reply()
        out.pop(STATS_TAG)
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------------ mooncake


def consumer_store(master: str):
    """A trainer-side store client (no global segment, as in the seed command)."""
    from dspark_jax.data.online.mooncake import MooncakeConfig, open_store

    return open_store(
        MooncakeConfig(
            local_hostname="127.0.0.1",
            master_server_address=master,
            global_segment_size=0,
            local_buffer_size=64 << 20,
        )
    )


# ------------------------------------------------------------------------ data


def make_data(path: Path, docs: int, tokens: int, seed: int) -> list[np.ndarray]:
    import datasets

    datasets.disable_progress_bars()
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 150_000, tokens) for _ in range(docs)]
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [x.tolist() for x in ids],
            "loss_mask": [[0] * 16 + [1] * (tokens - 16) for _ in ids],
            "seq_len": [tokens] * docs,
        }
    )
    ds.set_format("torch")
    ds.save_to_disk(str(path))
    return ids


class Checker:
    """Bit-equality of what each side delivered, against the extractor's tensors and
    against each other, on the documents of the first and last step."""

    def __init__(self, pool: np.ndarray, ids: list[np.ndarray], n_aux: int):
        self.pool, self.ids, self.n_aux = pool, ids, n_aux
        self.docs: list[int] = []
        self.ours: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # first jax run
        self.problems: list[str] = []

    def expected(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        e = expected_states(self.pool, self.ids[doc])
        return e[:, : self.n_aux].reshape(len(e), -1), e[:, self.n_aux]

    @staticmethod
    def same(a: np.ndarray, b: np.ndarray) -> bool:
        return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))

    def jax_step(self, label: str, data, step: int, batch: dict) -> None:
        plan = data.plan("train", 0)
        fill, lengths = 0, data.dataset.seq_len
        for doc in plan.row(step, 0).tolist():
            n = min(int(lengths[doc]), data.total_seq_len - fill)
            if n <= 0:
                break
            got = (
                np.asarray(batch["hidden_states"][0, fill : fill + n]),
                np.asarray(batch["verifier_last_hidden_states"][0, fill : fill + n]),
            )
            want = tuple(x[:n] for x in self.expected(doc))
            if not all(self.same(g, w) for g, w in zip(got, want)):
                self.problems.append(f"{label}: document {doc} differs from the extractor's")
            if n == lengths[doc] and doc not in self.ours:
                self.ours[doc] = got
                self.docs.append(doc)
            fill += n

    def reference_item(self, label: str, doc: int, item: dict) -> None:
        import torch

        got = tuple(
            item[k].view(torch.int16).numpy().view(BF16)
            for k in ("hidden_states", "verifier_last_hidden_states")
        )
        if not all(self.same(g, w) for g, w in zip(got, self.expected(doc))):
            self.problems.append(f"{label}: document {doc} differs from the extractor's")
        if doc in self.ours and not all(self.same(g, w) for g, w in zip(got, self.ours[doc])):
            self.problems.append(f"{label}: document {doc} differs from the jax pipeline's")

    def verdict(self, label: str) -> str:
        mine = [p for p in self.problems if p.startswith(label)]
        if mine:
            raise SystemExit("online_pipeline check FAILED: " + "; ".join(mine))
        return "ok"


# ------------------------------------------------------------------------ runs


def online_source(base_url: str, transport, in_flight: int):
    from dspark_jax.data.online.source import OnlineSettings, OnlineSource

    return OnlineSource(
        OnlineSettings(endpoint=base_url + "/v1", model=SERVED, requests_in_flight=in_flight),
        transport,
    )


def jax_transport(kind: str, store):
    from dspark_jax.data.online.mooncake import MooncakeConfig
    from dspark_jax.data.online.transport import FileTransport, MooncakeTransport

    if kind == "file":
        return FileTransport()
    return MooncakeTransport(MooncakeConfig(), store_factory=lambda: store)


def run_jax(args, data_path, hs_dir, base_url, kind, store, in_flight, checker, label,
            max_steps=None) -> dict:  # fmt: skip
    from dspark_jax.data.pipeline import PackedData

    online = online_source(base_url, jax_transport(kind, store), in_flight)
    data = PackedData(
        data_path,
        hs_dir,
        total_seq_len=args.seq_len,
        n_aux=args.n_aux,
        hidden_size=args.hidden,
        train_data_ratio=1.0,
        rows_per_process=1,
        process_index=0,
        process_count=1,
        on_missing="generate",
        online=online,
        read_files=kind == "file",
        hidden_states_dtype="bfloat16",
    )
    steps = data.steps_per_epoch("train", 0)
    kept = {}
    t0 = time.perf_counter()
    it = data.train_iterator(
        num_epochs=1, num_workers=0, prefetch=args.prefetch, read_threads=args.read_threads
    )
    n = 0
    for batch in it:
        if n in (0, steps - 1):
            kept[n] = batch
        n += 1
        if n == max_steps:
            break
    dt = time.perf_counter() - t0
    it.close()
    online.close()
    assert n == (max_steps or steps), (n, steps)
    s = online.stats
    if s.dropped or s.failed_round_trips:
        raise SystemExit(f"{label}: {s.dropped} dropped, {s.failed_round_trips} failed round trips")
    if checker is not None:
        for step, batch in kept.items():
            checker.jax_step(label, data, step, batch)
    return {"seconds": dt, "samples": s.generated, "steps": steps}


def run_reference(args, data_path, staging, base_url, kind, store, checker, label,
                  max_items=None) -> dict:  # fmt: skip
    import torch  # noqa: F401  (speculators' dataset hands out torch tensors)
    from hs_connectors.transfer import (
        FileTransfer,
        MooncakeHiddenStatesStore,
        MooncakeStoreConfig,
        MooncakeTransfer,
    )
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    if kind == "file":
        transfer = FileTransfer(Path(staging))
    else:
        hs_store = MooncakeHiddenStatesStore(MooncakeStoreConfig())
        hs_store._store = store  # already set up (against the bench's master)
        transfer = MooncakeTransfer(hs_store)
    ds = ArrowDataset(
        max_len=args.seq_len,
        datapath=str(data_path),
        transfer=transfer,
        vllm_endpoint=base_url + "/v1",
        on_missing="generate",
        model=SERVED,
        train_ratio=1.0,
    )
    want = set(checker.docs) if checker is not None else set()
    kept, unavailable = {}, 0
    t0 = time.perf_counter()
    for i in range(max_items or len(ds)):
        item = ds[i]
        if isinstance(item, SampleUnavailable):
            unavailable += 1
        elif i in want:
            kept[i] = item
    dt = time.perf_counter() - t0
    if unavailable:
        raise SystemExit(f"{label}: {unavailable} samples unavailable")
    for doc in want:
        checker.reference_item(label, doc, kept[doc])
    return {"seconds": dt, "samples": (max_items or len(ds)) - unavailable}


def warm_up(args, data_path, hs_dir, staging, base_url, kind, new_store) -> None:
    """One step of ours and two samples of the reference, untimed: lazy imports,
    server threads, connections, store segment pages, page cache."""
    run_jax(args, data_path, hs_dir, base_url, kind, new_store(), max(args.in_flight), None,
            "warm-up", max_steps=1)  # fmt: skip
    run_reference(args, data_path, staging, base_url, kind, new_store(), None, "warm-up",
                  max_items=2)  # fmt: skip


# ------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=None, help="N documents (default 64)")
    ap.add_argument("--tokens", type=int, default=None, help="T tokens per document (2048)")
    ap.add_argument("--hidden", type=int, default=None, help="H (1024)")
    ap.add_argument("--n-aux", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=None, help="S tokens per row (default 4T)")
    ap.add_argument("--extract-ms", type=float, default=50.0, help="server latency per request")
    ap.add_argument("--transports", nargs="+", choices=["file", "mooncake"],
                    default=["file", "mooncake"])  # fmt: skip
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument(
        "--read-threads",
        type=int,
        default=1,
        help="minimum Grain read threads (generating, the pipeline raises it to keep K requests busy)",
    )
    ap.add_argument("--prefetch", type=int, default=4, help="steps prefetched (trainer: 4)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (N 12, T 256, H 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        return serve_main(json.loads(args.serve))

    small = {"docs": 12, "tokens": 256, "hidden": 64} if args.quick else {}
    for k, v in {"docs": 64, "tokens": 2048, "hidden": 1024}.items():
        if getattr(args, k) is None:
            setattr(args, k, small.get(k, v))
    args.seq_len = args.seq_len or 4 * args.tokens

    from absl import flags

    flags.FLAGS.mark_as_parsed()
    root = args.dir or Path(tempfile.mkdtemp(prefix="dspark_online_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    sample_bytes = args.tokens * (args.n_aux + 1) * args.hidden * BF16.itemsize
    total_gb = args.docs * sample_bytes / 1e9
    base = {
        "bench": "online_pipeline",
        "extract_ms": args.extract_ms,
        "N": args.docs,
        "T": args.tokens,
        "H": args.hidden,
        "n_aux": args.n_aux,
        "S": args.seq_len,
    }
    masters, servers, stores = [], [], []
    summary = {}
    try:
        t0 = time.perf_counter()
        data_path = root / "prepared"
        ids = make_data(data_path, args.docs, args.tokens, args.seed)
        pool = make_pool(args.tokens, args.n_aux, args.hidden, args.seed)
        emit(
            {
                **base,
                "bench": "online_pipeline_setup",
                "sample_mib": round(sample_bytes / 2**20, 2),
                "hs_gb_per_pass": round(total_gb, 3),
                "setup_s": round(time.perf_counter() - t0, 2),
                "cpus": os.cpu_count(),
                "host": platform.node(),
                "loadavg": loadavg(),
            }
        )
        for kind in args.transports:
            cfg = {
                "transport": kind,
                "tokens": args.tokens,
                "n_aux": args.n_aux,
                "hidden": args.hidden,
                "seed": args.seed,
                "extract_ms": args.extract_ms,
                "staging": str(root / f"staging_{kind}"),
                "segment_bytes": max(1 << 30, 4 * max(args.in_flight) * sample_bytes),
            }
            store_kind = None
            if kind == "mooncake":
                try:
                    import mooncake.store  # noqa: F401

                    proc, cfg["master"] = start_master(root / "mooncake_master.log")
                except (ImportError, OSError) as e:
                    print(f"mooncake.store unavailable ({e}): no Mooncake lines", file=sys.stderr)
                    continue
                masters.append(proc)
                store_kind = "real"
            server = ServerProcess(cfg)
            servers.append(server)

            def new_store(cfg=cfg, kind=kind):
                if kind != "mooncake":
                    return None
                s = consumer_store(cfg["master"])
                stores.append(s)
                return s

            hs_dir = root / "no_hidden_state_files"
            warm_up(args, data_path, hs_dir, cfg["staging"], server.base_url, kind, new_store)
            server.stats()
            checker = Checker(pool, ids, args.n_aux)
            line = {**base, "transport": kind, "store": store_kind}
            results = {}
            for k in args.in_flight:
                label = f"jax/{kind}/{k}"
                r = run_jax(args, data_path, hs_dir, server.base_url, kind, new_store(), k,
                            checker, label)  # fmt: skip
                results[("jax", k)] = r
                emit(
                    {
                        **line,
                        "impl": "jax",
                        "in_flight": k,
                        "min_read_threads": args.read_threads,
                        "prefetch": args.prefetch,
                        "samples": r["samples"],
                        "steps": r["steps"],
                        "seconds": round(r["seconds"], 3),
                        "samples_per_s": round(r["samples"] / r["seconds"], 2),
                        "gb_per_s": round(r["samples"] * sample_bytes / r["seconds"] / 1e9, 3),
                        **server.stats(),
                        "check": checker.verdict(label),
                        "loadavg": loadavg(),
                    }
                )
            label = f"reference/{kind}"
            r = run_reference(args, data_path, cfg["staging"], server.base_url, kind,
                              new_store(), checker, label)  # fmt: skip
            emit(
                {
                    **line,
                    "impl": "reference",
                    "in_flight": 1,
                    "samples": r["samples"],
                    "seconds": round(r["seconds"], 3),
                    "samples_per_s": round(r["samples"] / r["seconds"], 2),
                    "gb_per_s": round(r["samples"] * sample_bytes / r["seconds"] / 1e9, 3),
                    **server.stats(),
                    "check": checker.verdict(label),
                    "checked_docs": len(checker.docs),
                    "loadavg": loadavg(),
                }
            )
            best_k = max(args.in_flight, key=lambda k: results[("jax", k)]["samples"]
                         / results[("jax", k)]["seconds"])  # fmt: skip
            best = results[("jax", best_k)]
            ref_rate = r["samples"] / r["seconds"]
            jax_rate = best["samples"] / best["seconds"]
            leftovers = len(list(Path(cfg["staging"]).iterdir())) if kind == "file" else None
            summary[kind] = {
                "store": store_kind,
                "reference_samples_per_s": round(ref_rate, 2),
                "jax_best_in_flight": best_k,
                "jax_best_samples_per_s": round(jax_rate, 2),
                "jax_samples_per_s": {
                    str(k): round(
                        results[("jax", k)]["samples"] / results[("jax", k)]["seconds"], 2
                    )
                    for k in args.in_flight
                },
                "speedup": round(jax_rate / ref_rate, 2),
                **({"staging_leftover_files": leftovers} if leftovers is not None else {}),
            }
        emit(
            {
                "bench": "online_pipeline_summary",
                "extract_ms": args.extract_ms,
                "latency_bound_sequential_samples_per_s": (
                    round(1000.0 / args.extract_ms, 2) if args.extract_ms else None
                ),
                "transports": summary,
                "check": "ok",
                "loadavg": loadavg(),
            }
        )
    finally:
        for s in servers:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001
                print(f"stopping the server: {e}", file=sys.stderr)
        for s in stores:
            if hasattr(s, "close"):
                s.close()
        for proc in masters:
            proc.terminate()
            proc.wait(timeout=10)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
