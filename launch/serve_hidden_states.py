"""A hidden-states extractor server without vLLM, backed by HF transformers.

Speaks the protocol of ``vllm serve`` with the ``extract_hidden_states``
speculative method and a hidden-states KV connector (docs/formats.md, "Online extraction
protocol"; client side: dspark_jax/data/online/client.py), so that online training
(``--on-missing generate``) and ``launch.extract_hidden_states --backend vllm
--endpoint ...`` work with small verifiers, on CPU, or in tests:

    python -m launch.serve_hidden_states MODEL [--target-layer-ids IDS ...]
        [--[no-]include-last-layer] [--host 127.0.0.1] [--port 8000]
        [--served-model-name NAME] [--dtype auto] [--compute-capability 9.0]
        [--device auto|cpu|cuda]
        [--trust-remote-code] [--max-model-len N] [--threads N]
        --hidden-states-backend file|mooncake
        [--hidden-states-path DIR]                      (file; default /tmp/hidden_states)
        [--mooncake-master HOST:PORT --mooncake-metadata-server P2PHANDSHAKE
         --mooncake-protocol tcp|rdma --mooncake-device '' --mooncake-global-segment-gib 4
         --mooncake-local-buffer-gib 2 --mooncake-writer-threads 4
         --mooncake-format packed|per-tensor]           (mooncake)

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (body
``{"model", "prompt": [token ids], "max_tokens": >= 1, "return_token_ids": true}``).
The answer is an OpenAI ``text_completion`` with ``choices[0].prompt_token_ids``,
``choices[0].token_ids`` = [the greedy next token] (final norm + lm_head of the
last position, computed from the same forward) and ``kv_transfer_params``:

* file backend (as vLLM's ``ExampleHiddenStatesConnector``):
  ``{"hidden_states_path": DIR/<request id>.safetensors}``. ``<path>.lock`` is
  created and exclusively flocked before the answer is sent; a writer thread
  writes the file after the answer, then releases the lock. The consumer takes
  the lock, deletes the ``.lock``, reads and deletes the file.
* mooncake backend: the tensors are published before the answer (the consumer
  polls anyway); ``packed`` (hs_connectors 0.9.0): the answer carries the
  manifest; ``per-tensor`` (the Kimi-K3 example branch): ``{"handle": KEY}``. A
  failed publish puts the ``KEY:error`` marker and answers 500.

As vLLM 0.33.0 would: the layer ids are ascending whatever order they were given in
(:func:`launch.hs_files.resolve_layer_ids`), and ``--dtype auto`` is the dtype vLLM
picks on a GPU of ``--compute-capability`` (a float32 config is served in bf16 from
8.0; :mod:`launch.vllm_dtype`).

Stored tensors: ``hidden_states`` [T, n_layers, H] in the model dtype and
``token_ids`` int64 [T], exactly :meth:`launch.hf_extract.HFExtractor.extract`
of the one-row batch (so files equal ``launch.extract_hidden_states --backend hf
--batch-size 1``'s bit for bit). Forwards are serialized (the extractor's hooks
are not thread-safe); HTTP requests are served by a thread each. Only one token
is ever generated: ``max_tokens`` > 1 is accepted and answered with one token
(``finish_reason`` ``"length"``), which is all an extraction client asks for.

SIGTERM / Ctrl-C: stops accepting, finishes the requests in flight, waits for the
writer threads, and removes nothing it already handed out.

Tests inject faults by subclassing :class:`HiddenStatesServer` (``extract``,
``forward``, ``publish``, ``complete``) or a publisher (``FilePublisher.write``,
``MooncakePublisher.put``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import fcntl
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, Self

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from launch.hf_extract import add_hf_forward_flags

log = logging.getLogger("launch.serve")

OWNED_BY = "dspark-jax"
MOONCAKE_FORMATS = ("packed", "per-tensor")


class RequestError(Exception):
    """A request the server refuses; ``status`` and an OpenAI-style error type."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
    }

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    def payload(self) -> dict:
        return error_payload(self.status, str(self))


def error_payload(status: int, message: str) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as vLLM answers errors."""
    return {
        "error": {
            "message": message,
            "type": RequestError.TYPES.get(status, "Error"),
            "param": None,
            "code": status,
        }
    }


def sanitize_key(key: str) -> str:
    """A request id as a Mooncake key (hs_connectors' ``sanitize_key``)."""
    safe = re.sub(r"[^a-zA-Z0-9_-]", "_", key)
    return ("k" + safe) if safe[:1].isdigit() else safe


def to_numpy(t: torch.Tensor):
    """A CPU tensor as a numpy array with the same bytes (bf16 / fp8 via ml_dtypes)."""
    from dspark_jax.data.online.mooncake import np_dtype

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np_dtype("bfloat16"))
    if t.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        return t.view(torch.uint8).numpy().view(np_dtype(str(t.dtype)))
    return t.numpy()


# --------------------------------------------------------------------------------------
# publishers (the transport)
# --------------------------------------------------------------------------------------

Deferred = Callable[[], None]


class Publisher:
    """Hands one sample to the consumer. ``publish`` returns the answer's
    ``kv_transfer_params`` and, optionally, work to run once the answer is sent."""

    name = "?"

    def publish(
        self, req_id: str, hidden_states: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[dict, Deferred | None]:
        raise NotImplementedError

    def close(self) -> None:
        """Wait for pending writes."""

    def describe(self) -> str:
        return self.name


class FilePublisher(Publisher):
    """``DIR/<req_id>.safetensors`` with the ``.lock`` protocol of vLLM's
    ``ExampleHiddenStatesConnector``."""

    name = "file"

    def __init__(self, directory: str | Path, writer_threads: int = 4):
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pool = cf.ThreadPoolExecutor(
            max_workers=writer_threads, thread_name_prefix="hs-file-writer"
        )

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Write the file (runs in a writer thread while the lock is held)."""
        from safetensors.torch import save_file

        from dspark_jax import file_mode

        save_file(tensors, str(path))
        file_mode.share(path)  # save_file creates it 0600; the trainer may be another user

    def _write_and_unlock(self, path: Path, tensors: dict[str, torch.Tensor], lock_fd: int) -> None:
        try:
            self.write(path, tensors)
        except BaseException:
            log.exception("writing %s failed", path)
            path.unlink(missing_ok=True)  # the consumer sees no file, not a partial one
        finally:
            os.close(lock_fd)  # releases the flock; the consumer deletes the .lock

    def publish(self, req_id, hidden_states, token_ids):
        path = self.directory / f"{req_id}.safetensors"
        lock_path = Path(str(path) + ".lock")
        fd = os.open(lock_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            lock_path.unlink(missing_ok=True)
            raise
        tensors = {
            "hidden_states": hidden_states.detach().to("cpu").contiguous(),
            "token_ids": token_ids.detach().to("cpu", torch.long).contiguous(),
        }

        def later() -> None:
            try:
                self._pool.submit(self._write_and_unlock, path, tensors, fd)
            except RuntimeError:  # pool shut down: write inline
                self._write_and_unlock(path, tensors, fd)

        return {"hidden_states_path": str(path)}, later

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def describe(self) -> str:
        return f"file {self.directory}"


class MooncakePublisher(Publisher):
    """Puts samples into a Mooncake store (``dspark_jax.data.online.mooncake``) from a fixed
    pool of writer threads (the store's registered staging buffers are per thread, so
    a bounded pool bounds them), then answers."""

    name = "mooncake"

    def __init__(self, hidden_states, fmt: str = "packed", writer_threads: int = 4):
        if fmt not in MOONCAKE_FORMATS:
            raise ValueError(f"--mooncake-format must be one of {MOONCAKE_FORMATS}, not {fmt!r}")
        self.mc, self.format = hidden_states, fmt
        self._pool = cf.ThreadPoolExecutor(
            max_workers=writer_threads, thread_name_prefix="hs-mooncake-writer"
        )

    def put(self, key: str, hidden_states, token_ids) -> dict:
        """Publish numpy arrays under ``key``; the kv_transfer_params."""
        if self.format == "packed":
            return self.mc.put_packed(key, hidden_states, token_ids)
        return self.mc.put_per_tensor(key, hidden_states, token_ids)

    def _put(self, key: str, hidden_states, token_ids) -> dict:
        try:
            return self.put(key, hidden_states, token_ids)
        except BaseException as e:
            try:  # a consumer that got the key anyway fails fast instead of timing out
                self.mc.put_error(key, f"{type(e).__name__}: {e}")
            except Exception:
                log.exception("could not publish the error marker of %s", key)
            for suffix in ("", ":hidden_states", ":token_ids", ":meta"):  # partial data
                try:
                    self.mc.store.remove(key + suffix, force=True)
                except Exception as cleanup:  # noqa: BLE001
                    log.debug("removing %s%s: %s", key, suffix, cleanup)
            raise

    def publish(self, req_id, hidden_states, token_ids):
        key = sanitize_key(req_id)
        hs, tok = to_numpy(hidden_states), to_numpy(token_ids.to(torch.long))
        return self._pool.submit(self._put, key, hs, tok).result(), None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def describe(self) -> str:
        return f"mooncake {self.format}"


# --------------------------------------------------------------------------------------
# server
# --------------------------------------------------------------------------------------


def _text_config(config):
    return getattr(config, "text_config", None) or config


class HiddenStatesServer:
    """The HTTP server. ``extractor``: an :class:`launch.hf_extract.HFExtractor` (or
    anything with ``extract([ids]) -> [tensor]``, ``layer_ids``, ``model``, ``decoder``).

    Hooks for subclasses: :meth:`extract` (prompt -> hidden states), :meth:`forward`
    (prompt -> hidden states, greedy next token), :meth:`publish`, :meth:`complete`
    (body -> status, payload)."""

    def __init__(
        self,
        extractor,
        served_model_name: str,
        publisher: Publisher,
        *,
        model: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        tokenizer=None,
        max_model_len: int | None = None,
        request_timeout: float = 600.0,
    ):
        self.extractor = extractor
        self.served_model_name = served_model_name
        self.model = model or getattr(extractor, "model_name", None) or served_model_name
        self.publisher = publisher
        self.tokenizer = tokenizer
        hf_model = getattr(extractor, "model", None)
        config = _text_config(hf_model.config) if hf_model is not None else None
        if max_model_len is None and config is not None:
            max_model_len = getattr(config, "max_position_embeddings", None)
        self.max_model_len = max_model_len
        self.vocab_size = None
        if hf_model is not None:
            emb = hf_model.get_input_embeddings()
            self.vocab_size = int(getattr(emb, "num_embeddings", 0)) or getattr(
                config, "vocab_size", None
            )
        self._forward_lock = threading.RLock()
        self._local = threading.local()
        self.httpd = ThreadingHTTPServer(
            (host, port), self._handler(request_timeout), bind_and_activate=False
        )
        # a thread per request; stop() joins those in flight (their deferred writes
        # are then queued) before waiting for the writers
        self.httpd.daemon_threads = False
        self.httpd.block_on_close = True
        try:
            self.httpd.server_bind()
            self.httpd.server_activate()
        except BaseException:
            self.httpd.server_close()
            raise
        self.host = host
        self.port = int(self.httpd.server_address[1])
        shown = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self.base_url = f"http://{shown}:{self.port}"
        self._thread: threading.Thread | None = None
        self._stopped = False

    # ----------------------------------------------------------------- model
    def extract(self, prompt: Sequence[int]) -> torch.Tensor:
        """Hidden states ``[T, n_layers, H]`` of one prompt (a one-row forward)."""
        with self._forward_lock:
            return self.extractor.extract([list(prompt)])[0]

    @torch.inference_mode()
    def next_token(self, final_hidden: torch.Tensor | None, hidden_states: torch.Tensor) -> int:
        """Greedy next token from the post-norm last-position hidden state (captured
        from the decoder's output), or, when an :meth:`extract` override bypassed the
        model, from the last slot of ``hidden_states`` if that is layer N (final norm
        applied here); 0 when neither is available."""
        model = getattr(self.extractor, "model", None)
        if model is None:
            return 0
        if final_hidden is None:
            decoder = getattr(self.extractor, "decoder", None)
            norm = getattr(decoder, "norm", None)
            n = getattr(self.extractor, "num_hidden_layers", None)
            ids = list(getattr(self.extractor, "layer_ids", []))
            if norm is None or not ids or ids[-1] != n:
                return 0
            device = next(model.parameters()).device
            final_hidden = norm(hidden_states[-1:, -1].to(device))
        logits = model.get_output_embeddings()(final_hidden)
        return int(logits[-1].float().argmax())

    def forward(self, prompt: Sequence[int]) -> tuple[torch.Tensor, int]:
        """(hidden states, greedy next token) of one prompt, from one forward."""
        captured: dict[str, torch.Tensor] = {}
        decoder = getattr(self.extractor, "decoder", None)

        def hook(_mod, _args, output):
            # a ModelOutput or tuple: item 0 is the post-norm last_hidden_state
            last = output if isinstance(output, torch.Tensor) else output[0]
            captured["h"] = last[0, -1:].detach()

        with self._forward_lock:
            handle = decoder.register_forward_hook(hook) if decoder is not None else None
            try:
                hidden_states = self.extract(prompt)
            finally:
                if handle is not None:
                    handle.remove()
            token = self.next_token(captured.get("h"), hidden_states)
        return hidden_states, token

    # ----------------------------------------------------------------- protocol
    def publish(self, req_id: str, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> dict:
        """Hand the sample to the transport; the answer's ``kv_transfer_params``.
        Deferred work (the file write) runs after the answer is sent."""
        params, later = self.publisher.publish(req_id, hidden_states, token_ids)
        if later is not None:
            self._defer(later)
        return params

    def _defer(self, fn: Deferred) -> None:
        pending = getattr(self._local, "after", None)
        if pending is None:  # not inside a request handler: nothing to wait for
            fn()
        else:
            pending.append(fn)

    def new_request_id(self) -> str:
        return f"cmpl-{uuid.uuid4().hex}"

    def models(self) -> dict:
        entry = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": OWNED_BY,
            "root": self.model,
            "parent": None,
        }
        if self.max_model_len:
            entry["max_model_len"] = int(self.max_model_len)
        return {"object": "list", "data": [entry]}

    def validate(self, body: Any) -> list[int]:
        """The prompt of a completion request; raises :class:`RequestError`."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.served_model_name:
            raise RequestError(404, f"The model `{model}` does not exist.")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported by this server")
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise RequestError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        prompt = body.get("prompt")
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise RequestError(
                400,
                "prompt must be a non-empty list of token ids (one prompt "
                "per request; text prompts are not supported)",
            )
        if self.vocab_size and not all(0 <= t < self.vocab_size for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise RequestError(
                400, f"token id {bad} is out of vocabulary range [0, {self.vocab_size})"
            )
        if self.max_model_len and len(prompt) > self.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is "
                f"{self.max_model_len} tokens. However, your prompt has "
                f"{len(prompt)} tokens.",
            )
        return prompt

    def complete(self, body: Any) -> tuple[int, dict]:
        """One completion request: (HTTP status, JSON payload)."""
        try:
            prompt = self.validate(body)
        except RequestError as e:
            return e.status, e.payload()
        req_id = self.new_request_id()
        try:
            hidden_states, token = self.forward(prompt)
        except Exception as e:
            log.exception("%s: extraction failed", req_id)
            return 500, error_payload(
                500, f"hidden-state extraction failed: {type(e).__name__}: {e}"
            )
        token_ids = torch.tensor(prompt, dtype=torch.long)
        try:
            params = self.publish(req_id, hidden_states, token_ids)
        except Exception as e:
            log.exception("%s: publishing the hidden states failed", req_id)
            return 500, error_payload(
                500, f"publishing the hidden states failed: {type(e).__name__}: {e}"
            )
        want_ids = bool(body.get("return_token_ids"))
        text = ""
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode([token])
            except Exception:  # noqa: BLE001
                text = ""
        n = len(prompt)
        return 200, {
            "id": req_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": list(prompt) if want_ids else None,
                    "token_ids": [token] if want_ids else None,
                }
            ],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
            "system_fingerprint": None,
            "kv_transfer_params": params,
        }

    # ----------------------------------------------------------------- HTTP
    def _handler(self, request_timeout: float):
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout
            server_version = "dspark-jax-serve-hidden-states"

            def log_message(self, fmt, *args):  # route to logging, quietly
                log.debug("%s " + fmt, self.address_string(), *args)

            def _send(self, code: int, payload: dict | None) -> None:
                body = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)
                self.wfile.flush()

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    self._send(200, None)
                elif path == "/v1/models":
                    self._send(200, server.models())
                else:
                    self._send(404, error_payload(404, f"no route GET {path}"))

            def do_POST(self):
                path = self.path.split("?", 1)[0]
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(length) if length > 0 else b""
                except (ValueError, OSError) as e:
                    return self._send(400, error_payload(400, f"unreadable request: {e}"))
                if path != "/v1/completions":
                    return self._send(404, error_payload(404, f"no route POST {path}"))
                try:
                    body = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    return self._send(400, error_payload(400, f"the body is not JSON: {e}"))
                server._local.after = []
                try:
                    code, payload = server.complete(body)
                    try:
                        self._send(code, payload)
                    except (BrokenPipeError, ConnectionResetError):
                        # The client gave up (its timeout); it will ask again. What was
                        # published for this answer is nobody's now (as with vLLM).
                        log.warning(
                            "%s: the client closed the connection before the answer "
                            "(%s left unclaimed)",
                            payload.get("id", "request"),
                            payload.get("kv_transfer_params"),
                        )
                finally:  # deferred work runs even if the client went away
                    after, server._local.after = server._local.after, None
                    for fn in after:
                        fn()

        return Handler

    def start(self) -> HiddenStatesServer:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="hs-server", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        """Stop accepting, finish requests in flight, wait for the writers. Removes
        nothing that was handed out."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()  # joins the request threads
        self.publisher.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        host = self.host if self.host else "0.0.0.0"
        host = f"[{host}]" if ":" in host else host
        impl = getattr(self.extractor, "attn_implementation", None)
        attention = f", attention {impl}" if impl else ""
        return (
            f"serving {self.model} as {self.served_model_name} on "
            f"http://{host}:{self.port}/v1 "
            f"(layers {list(getattr(self.extractor, 'layer_ids', []))}, "
            f"backend {self.publisher.describe()}{attention})"
        )


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Serve hidden states over vLLM's extraction protocol with HF transformers "
        "(no vLLM needed)."
    )
    ap.add_argument("model", help="verifier: HF id or local folder")
    ap.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="aux layer ids, without the final layer (appended); served in ascending "
        "order; default [2, N//2, N-3, N]",
    )
    ap.add_argument(
        "--include-last-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the last layer N (default: yes)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (see the log)")
    ap.add_argument("--served-model-name", default=None, help="model id (default: MODEL)")
    ap.add_argument(
        "--dtype", default="auto", help="model dtype (auto: what vLLM 0.33.0 would pick)"
    )
    ap.add_argument(
        "--compute-capability",
        default=None,
        help="GPU class whose vLLM --dtype auto to imitate (default: this machine's GPU, else 8.0)",
    )
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if any)")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt accepted (default: max_position_embeddings)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_hf_forward_flags(ap)
    ap.add_argument("--hidden-states-backend", choices=["file", "mooncake"], required=True)
    g = ap.add_argument_group("file backend")
    g.add_argument(
        "--hidden-states-path",
        default="/tmp/hidden_states",
        help="folder the files are written to, shared with the consumer "
        "(default /tmp/hidden_states)",
    )
    g.add_argument("--file-writer-threads", type=int, default=4)
    g = ap.add_argument_group("mooncake backend (as hs_connectors' flags)")
    g.add_argument(
        "--mooncake-master", default="127.0.0.1:50051", help="Mooncake master server address"
    )
    g.add_argument("--mooncake-metadata-server", default="P2PHANDSHAKE")
    g.add_argument("--mooncake-protocol", choices=["tcp", "rdma"], default="tcp")
    g.add_argument(
        "--mooncake-device",
        default="",
        help="transport device(s), e.g. mlx5_0 (empty: Mooncake chooses)",
    )
    g.add_argument("--mooncake-global-segment-gib", type=float, default=4.0)
    g.add_argument("--mooncake-local-buffer-gib", type=float, default=2.0)
    g.add_argument("--mooncake-writer-threads", type=int, default=4)
    g.add_argument(
        "--mooncake-format",
        choices=list(MOONCAKE_FORMATS),
        default="packed",
        help="packed: hs_connectors 0.9.0 (manifest in the answer); per-tensor: "
        "the Kimi-K3 example format (K:hidden_states, K:token_ids, K:meta)",
    )
    return ap.parse_args(argv)


def _local_hostname() -> str:
    env = os.environ.get("MOONCAKE_LOCAL_HOSTNAME")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "localhost"


def build_publisher(args: argparse.Namespace) -> Publisher:
    if args.hidden_states_backend == "file":
        return FilePublisher(args.hidden_states_path, writer_threads=args.file_writer_threads)
    from dspark_jax.data.online.mooncake import MooncakeConfig, MooncakeHiddenStates, open_store

    config = MooncakeConfig.from_gib(
        global_segment_gib=args.mooncake_global_segment_gib,
        local_buffer_gib=args.mooncake_local_buffer_gib,
        local_hostname=_local_hostname(),
        metadata_server=args.mooncake_metadata_server,
        master_server_address=args.mooncake_master,
        protocol=args.mooncake_protocol,
        device_name=args.mooncake_device,
        num_writer_threads=args.mooncake_writer_threads,
    )
    return MooncakePublisher(
        MooncakeHiddenStates(open_store(config)),
        args.mooncake_format,
        writer_threads=args.mooncake_writer_threads,
    )


def build_server(args: argparse.Namespace) -> HiddenStatesServer:
    from launch.hf_extract import HFExtractor

    extractor = HFExtractor.from_args(args)
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            args.model, trust_remote_code=args.trust_remote_code
        )
    except Exception as e:  # noqa: BLE001
        log.warning("no tokenizer for %s (%s); completions carry empty text", args.model, e)
    publisher = build_publisher(args)
    try:
        return HiddenStatesServer(
            extractor,
            args.served_model_name or args.model,
            publisher,
            model=args.model,
            host=args.host,
            port=args.port,
            tokenizer=tokenizer,
            max_model_len=args.max_model_len,
        )
    except BaseException:
        publisher.close()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    server = build_server(args)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("%s: shutting down", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server.start()
    log.info("%s", server.describe())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
        log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
