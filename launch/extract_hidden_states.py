"""Extract verifier hidden states for a prepared dataset: ``hs_{i}.safetensors`` files.

Two backends write identical files (docs/formats.md, "Hidden-state files"): ``hidden_states``
``[T, n_aux + 1, H]`` in the model dtype, one slot per layer id in ascending order
(as vLLM captures them), the last one the last layer (pre-norm), and ``token_ids``
int64 ``[T]``.

* ``--backend hf``: transformers on CPU or GPU, forward hooks, batched by a token
  budget.
* ``--backend vllm``: launches ``vllm serve`` with the ``extract_hidden_states``
  speculative method and the file KV connector (arguments after ``--`` go to
  vLLM), waits for ``/health``, sends the completion requests concurrently,
  moves and validates the files; or, with ``--endpoint``, uses a server that is
  already running (started e.g. by ``python -m launch.launch_vllm``).

Layer id ``k`` = residual stream after ``k`` decoder layers (0 = embeddings);
``--target-layer-ids`` excludes the final layer, which is appended
(``--no-include-last-layer`` to not). Default ids: ``[2, N//2, N-3, N]``, as
speculators' launcher. ``--dtype auto`` is the dtype vLLM 0.33.0 would pick on a GPU
of ``--compute-capability`` (a float32 config: bf16 from 8.0), for both backends;
the vllm backend passes it to ``vllm serve --dtype``.

Resumable: files already present and valid (read whole: shape, dtype, token ids,
finite values) are skipped; invalid ones (a NaN, a truncated file) are regenerated; every file appears by an atomic rename,
so an interrupted run leaves no partial file behind. Samples that fail are
counted and listed; the exit status is 1 if any failed.

    python -m launch.extract_hidden_states --backend hf --model configs/demo/verifier \\
        --preprocessed-data runs/demo/data --target-layer-ids 1 2 3

    python -m launch.extract_hidden_states --backend vllm --model Qwen/Qwen3-8B \\
        --preprocessed-data runs/q/data --target-layer-ids 2 18 33 \\
        -- --tensor-parallel-size 2 --max-model-len 8193 --no-enable-prefix-caching
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.hf_extract import add_hf_forward_flags  # noqa: E402
from launch.hs_files import (  # noqa: E402
    HiddenStatesError,
    existing_indices,
    hs_path,
    load_and_check,
    remove_partials,
    resolve_layer_ids,
    save_hidden_states,
    write_or_check_config,
)

log = logging.getLogger("launch.extract")


@dataclass
class Summary:
    planned: int = 0
    skipped_valid: int = 0
    invalid_existing: int = 0
    written: int = 0
    failed: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0

    def report(self) -> str:
        s = (
            f"{self.written} written, {self.skipped_valid} already present and valid, "
            f"{self.invalid_existing} invalid existing file(s) regenerated, "
            f"{len(self.failed)} failed, of {self.planned} planned ({self.seconds:.1f}s)"
        )
        if self.failed:
            shown = sorted(self.failed)[:20]
            s += (
                "\nfailed samples: "
                + ", ".join(map(str, shown))
                + (", ..." if len(self.failed) > len(shown) else "")
            )
            s += "\nfirst failure: " + self.failed[shown[0]]
        return s


def indices_for_rank(num_rows: int, max_samples: int | None, world_size: int, rank: int) -> range:
    """This rank's contiguous share of the first ``max_samples`` rows (speculators'
    ``get_indices_to_process`` split)."""
    target = min(max_samples, num_rows) if max_samples is not None else num_rows
    if target <= 0:
        return range(0)
    chunk, rem = divmod(target, world_size)
    start = rank * chunk + min(rank, rem)
    return range(start, start + chunk + (1 if rank < rem else 0))


class Rows:
    """Token ids of the prepared rows (read straight from the Arrow files)."""

    def __init__(self, path: str | Path):
        from datasets import load_from_disk

        self.ds = load_from_disk(str(path)).with_format(None)
        if "input_ids" not in self.ds.column_names:
            raise ValueError(f"{path}: not a prepared dataset (no input_ids column)")
        self.lengths = (
            list(self.ds["seq_len"])
            if "seq_len" in self.ds.column_names
            else [len(x) for x in self.ds["input_ids"]]
        )

    def __len__(self) -> int:
        return len(self.ds)

    def ids(self, i: int) -> list[int]:
        return list(self.ds[int(i)]["input_ids"])


def plan(
    rows: Rows,
    out_dir: Path,
    indices: Sequence[int],
    *,
    num_slots: int,
    hidden_size: int,
    dtype: str | None,
    summary: Summary,
) -> list[int]:
    """Indices still to extract; valid existing files are skipped, invalid ones removed.

    Each existing file is read whole (a NaN is only seen in the values): a rerun costs a
    read of the folder, and nothing unchecked is counted as done."""
    removed = remove_partials(out_dir)
    if removed:
        log.info("removed %d partial file(s) left by an interrupted run", removed)
    present = set(existing_indices(out_dir))
    todo = []
    for i in indices:
        if i in present:
            try:
                load_and_check(
                    hs_path(out_dir, i),
                    rows.ids(i),
                    num_slots=num_slots,
                    hidden_size=hidden_size,
                    dtype=dtype,
                )
                summary.skipped_valid += 1
                continue
            except HiddenStatesError as e:
                log.warning("%s; regenerating", e)
                hs_path(out_dir, i).unlink(missing_ok=True)
                summary.invalid_existing += 1
        todo.append(i)
    summary.planned = len(indices)
    return todo


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="row", dynamic_ncols=True, mininterval=1.0)


# --------------------------------------------------------------------------------------
# hf backend
# --------------------------------------------------------------------------------------


def make_batches(
    indices: Sequence[int], lengths: Sequence[int], batch_size: int, max_tokens: int
) -> list[list[int]]:
    """Longest rows first; a batch holds at most ``batch_size`` rows and
    ``max_tokens`` padded tokens (a single longer row goes alone)."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) >= batch_size or width * (len(cur) + 1) > max_tokens):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def run_hf(args, rows: Rows, out_dir: Path, indices: Sequence[int], summary: Summary) -> None:

    from launch.hf_extract import HFExtractor

    ex = HFExtractor.from_args(args)
    write_or_check_config(
        out_dir,
        {
            "layer_ids": ex.layer_ids,
            "num_hidden_layers": ex.num_hidden_layers,
            "hidden_size": ex.hidden_size,
            "dtype": ex.dtype_name,
            "compute_dtype": ex.compute_dtype_name,
            "attn_implementation": ex.attn_implementation,
            "model": args.model,
            "backend": "hf",
        },
    )
    todo = plan(
        rows,
        out_dir,
        indices,
        num_slots=len(ex.layer_ids),
        hidden_size=ex.hidden_size,
        dtype=ex.dtype_name,
        summary=summary,
    )
    log.info(
        "hf backend: computes in %s (attention %s), stores %s, layers %s, %d rows to extract",
        ex.compute_dtype_name,
        ex.attn_implementation,
        ex.dtype_name,
        ex.layer_ids,
        len(todo),
    )
    with _progress(len(todo), "extract (hf)") as bar:
        for batch in make_batches(todo, rows.lengths, args.batch_size, args.max_tokens_per_batch):
            token_rows = [rows.ids(i) for i in batch]
            for i, ids, hs in zip(batch, token_rows, ex.extract(token_rows)):
                save_hidden_states(hs_path(out_dir, i), hs, ids)
                summary.written += 1
            bar.update(len(batch))


# --------------------------------------------------------------------------------------
# vllm backend
# --------------------------------------------------------------------------------------


def verifier_config(model: str, trust_remote_code: bool):
    """(the transformers config, its text config) of the verifier."""
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    return full, getattr(full, "text_config", None) or full


def served_dtype(args, config) -> str:
    """The dtype vLLM serves in: ``--dtype``, else vLLM's ``--dtype`` after ``--``,
    resolved as vLLM 0.33.0 does on a GPU of ``--compute-capability``."""
    from launch.vllm_backend import option_value
    from launch.vllm_dtype import DTYPE_NAMES, serving_dtype, target_capability

    theirs = option_value(args.vllm_args, "--dtype") or "auto"
    ours = args.dtype.lower()
    if "auto" not in (ours, theirs.lower()) and DTYPE_NAMES.get(ours) != DTYPE_NAMES.get(
        theirs.lower()
    ):
        raise ValueError(f"--dtype {args.dtype} and vLLM's --dtype {theirs} (after --) disagree")
    requested = theirs if ours == "auto" else ours
    capability = target_capability(args.compute_capability)
    return serving_dtype(requested, config, args.model, capability)


def serve_args(args, config) -> tuple[list[int], str, list[str]]:
    """(layer ids, served dtype, vLLM args with that ``--dtype``) of the server; refuses
    an MLA verifier (the file connector cannot serve it)."""
    from launch.mla import file_transport_refusal
    from launch.vllm_backend import set_option

    full, text = config
    refusal = file_transport_refusal(full, args.model)
    if refusal:
        raise ValueError(refusal)
    n_layers = int(text.num_hidden_layers)
    layer_ids = resolve_layer_ids(args.target_layer_ids, n_layers, args.include_last_layer)
    dtype = served_dtype(args, full)
    return layer_ids, dtype, set_option(args.vllm_args, "--dtype", dtype)


def run_vllm(args, rows: Rows, out_dir: Path, indices: Sequence[int], summary: Summary) -> None:
    from launch import vllm_backend as vb

    config = verifier_config(args.model, args.trust_remote_code)
    n_layers, hidden = int(config[1].num_hidden_layers), int(config[1].hidden_size)
    layer_ids, model_dtype, vllm_args = serve_args(args, config)
    fp8 = args.hidden_states_backend == "fp8"
    dtype = None if fp8 else model_dtype
    staging = Path(args.hidden_states_path or out_dir / ".staging").resolve()
    served = args.served_model_name or vb.option_value(args.vllm_args, "--served-model-name")

    write_or_check_config(
        out_dir,
        {
            "layer_ids": layer_ids,
            "num_hidden_layers": n_layers,
            "hidden_size": hidden,
            "dtype": "float8_e4m3fn" if fp8 else dtype,
            "model": args.model,
            "backend": "vllm",
        },
    )
    todo = plan(
        rows,
        out_dir,
        indices,
        num_slots=len(layer_ids),
        hidden_size=hidden,
        dtype=dtype,
        summary=summary,
    )
    if not todo:
        return

    cmd = vb.serve_command(
        args.model,
        layer_ids,
        vb.file_kv_transfer_config(staging, fp8=fp8),
        vllm_args,
        python=args.vllm_python,
    )
    if args.endpoint:
        endpoint = args.endpoint.rstrip("/")
        server = None
    else:
        port = vb.option_value(args.vllm_args, "--port") or "8000"
        endpoint = f"http://127.0.0.1:{port}/v1"
        staging.mkdir(parents=True, exist_ok=True)
        server = vb.VllmServer(
            cmd,
            endpoint.removesuffix("/v1"),
            out_dir / "vllm_server.log",
            health_timeout=args.health_timeout,
        )
    client = vb.VllmClient(
        endpoint,
        served or args.model,
        request_timeout=args.request_timeout,
        max_retries=args.max_retries,
        retry_backoff=args.retry_backoff,
        validation_retries=args.generation_validation_retries,
        lock_timeout=args.lock_timeout,
    )

    def go():
        client.check_model()
        log.info(
            "vllm backend: %s at %s, layers %s, %d rows to extract",
            client.model,
            endpoint,
            layer_ids,
            len(todo),
        )
        _run_concurrent(client, rows, out_dir, todo, args, summary, len(layer_ids), hidden, dtype)

    try:
        if server is None:
            go()
        else:
            with server:
                go()
    finally:
        if server is not None:
            try:
                staging.rmdir()  # only when empty: a leftover file stays visible
            except OSError:
                pass


def _run_concurrent(
    client,
    rows: Rows,
    out_dir: Path,
    todo: Sequence[int],
    args,
    summary: Summary,
    num_slots: int,
    hidden: int,
    dtype: str | None,
) -> None:
    from launch.vllm_backend import SampleError

    max_consecutive = args.max_consecutive_errors or args.concurrency
    consecutive = 0
    pending: dict[cf.Future, int] = {}
    it = iter(todo)
    with (
        cf.ThreadPoolExecutor(max_workers=args.concurrency) as pool,
        _progress(len(todo), "extract (vllm)") as bar,
    ):

        def submit_next() -> bool:
            i = next(it, None)
            if i is None:
                return False
            fut = pool.submit(
                client.fetch,
                i,
                rows.ids(i),
                out_dir,
                num_slots=num_slots,
                hidden_size=hidden,
                dtype=dtype,
            )
            pending[fut] = i
            return True

        for _ in range(args.concurrency * 2):
            if not submit_next():
                break
        try:
            while pending:
                done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        fut.result()
                        summary.written += 1
                        consecutive = 0
                    except SampleError as e:
                        summary.failed[i] = str(e)
                        consecutive += 1
                        log.error("%s", e)
                        if args.fail_on_error:
                            raise
                        if consecutive >= max_consecutive:
                            raise RuntimeError(
                                f"aborting: {consecutive} consecutive samples failed (is the "
                                f"server reachable?); last: {e}"
                            ) from e
                    bar.update(1)
                    submit_next()
        finally:
            for fut in pending:
                fut.cancel()


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, vllm_args = argv[:k], argv[k + 1 :]
    ap = argparse.ArgumentParser(
        description="Extract verifier hidden states (hs_{i}.safetensors) for a prepared dataset.",
        usage="extract_hidden_states.py --model MODEL --preprocessed-data DIR [options] "
        "[-- VLLM_SERVE_ARGS]",
    )
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--model", required=True, help="verifier: HF id or local folder")
    ap.add_argument(
        "--preprocessed-data",
        "--data-path",
        dest="preprocessed_data",
        required=True,
        help="prepared dataset folder (launch.prepare_data output)",
    )
    ap.add_argument(
        "--output",
        default=None,
        help="folder for hs_{i}.safetensors (default: <preprocessed-data>/hidden_states)",
    )
    ap.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="aux layer ids, without the final layer (appended); stored in ascending order; "
        "default [2, N//2, N-3, N]",
    )
    ap.add_argument("--include-last-layer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--world-size", type=int, default=1, help="number of extraction nodes")
    ap.add_argument("--rank", type=int, default=0, help="this node's index in [0, world-size)")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="model dtype, passed to vllm serve (auto: what vLLM 0.33.0 picks on a GPU of "
        "--compute-capability; a float32 config gives bfloat16 from 8.0)",
    )
    ap.add_argument(
        "--compute-capability",
        default=None,
        help="GPU class the verifier runs on, for --dtype auto (default: this machine's "
        "GPU, else 8.0)",
    )
    g = ap.add_argument_group("hf backend")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if any)")
    add_hf_forward_flags(g)
    g.add_argument("--batch-size", type=int, default=8, help="rows per forward")
    g.add_argument(
        "--max-tokens-per-batch", type=int, default=16384, help="padded tokens per forward"
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g = ap.add_argument_group("vllm backend")
    g.add_argument(
        "--endpoint",
        default=None,
        help="use a running server (e.g. http://host:8000/v1) instead of launching one",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model id the server reports (default: --served-model-name in the vLLM "
        "args, else --model)",
    )
    g.add_argument(
        "--hidden-states-backend",
        choices=["file", "fp8"],
        default="file",
        help="KV connector writing the files (fp8: hs_connectors' FP8 connector)",
    )
    g.add_argument(
        "--hidden-states-path",
        default=None,
        help="connector staging folder, visible to server and client (default: <output>/.staging)",
    )
    g.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    g.add_argument("--request-timeout", type=float, default=120.0)
    g.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="retries of a request on connection errors, timeouts, HTTP 408/429/5xx",
    )
    g.add_argument(
        "--retry-backoff",
        type=float,
        default=2.0,
        help="first retry wait in seconds, doubled each retry",
    )
    g.add_argument(
        "--generation-validation-retries",
        type=int,
        default=2,
        help="repeats of a whole round trip whose answer or file is invalid",
    )
    g.add_argument(
        "--lock-timeout", type=float, default=60.0, help="seconds to wait for the connector's .lock"
    )
    g.add_argument(
        "--max-consecutive-errors",
        type=int,
        default=None,
        help="abort after this many failed samples in a row (default: --concurrency)",
    )
    g.add_argument("--fail-on-error", action="store_true", help="abort at the first failed sample")
    g.add_argument(
        "--validate-outputs",
        action="store_true",
        help="accepted for speculators compatibility; files are always validated",
    )
    g.add_argument(
        "--health-timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for a launched server's /health",
    )
    g.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="python of the vLLM environment used to launch the server",
    )
    g.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    args = ap.parse_args(argv)
    args.vllm_args = vllm_args
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        ap.error("--rank must be in [0, --world-size)")
    if args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    return args


def run(args: argparse.Namespace) -> Summary:
    # Created by write_or_check_config once the verifier has loaded: a refused verifier
    # leaves nothing behind.
    out_dir = Path(args.output or Path(args.preprocessed_data) / "hidden_states")
    rows = Rows(args.preprocessed_data)
    indices = indices_for_rank(len(rows), args.max_samples, args.world_size, args.rank)
    summary = Summary()
    t0 = time.time()
    try:
        (run_hf if args.backend == "hf" else run_vllm)(args, rows, out_dir, indices, summary)
    finally:
        summary.seconds = time.time() - t0
        remove_partials(out_dir)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    from dspark_jax.cli import guarded

    return guarded(_main, argv)


def _main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.dry_run:
        from launch import vllm_backend as vb

        ids, _, vllm_args = serve_args(args, verifier_config(args.model, args.trust_remote_code))
        out_dir = Path(args.output or Path(args.preprocessed_data) / "hidden_states")
        staging = Path(args.hidden_states_path or out_dir / ".staging").resolve()
        cmd = vb.serve_command(
            args.model,
            ids,
            vb.file_kv_transfer_config(staging, fp8=args.hidden_states_backend == "fp8"),
            vllm_args,
            python=args.vllm_python,
        )
        print(shlex.join(cmd))
        return 0
    try:
        summary = run(args)
    except KeyboardInterrupt:
        log.warning("interrupted; finished files are kept, run again to resume")
        return 130
    log.info("%s", summary.report())
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
