"""A stand-in for ``vllm serve`` with ``extract_hidden_states`` + the file KV connector.

It speaks the same HTTP protocol as vLLM 0.33 for what the extraction client
uses: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (OpenAI
completions with ``return_token_ids``; the answer carries
``choices[0].prompt_token_ids`` and ``kv_transfer_params.hidden_states_path``),
and writes files the way ``ExampleHiddenStatesConnector`` does: the ``.lock``
file is created and exclusively flocked before the answer is sent, the
safetensors file is written afterwards by a writer thread, which then releases
the lock. In-process, hidden states come from a real HF forward of the verifier
(:class:`launch.hf_extract.HFExtractor`), so the files must equal the hf
backend's; the subprocess form (``serve_main``) writes deterministic values that
depend on the layer id, with numpy only, so that it starts in a fraction of a second.

It imitates vLLM 0.33.0 where our launchers could get it wrong, independently of
their code: layers are captured in ascending order whatever order
``eagle_aux_hidden_state_layer_ids`` lists them in (``interfaces.py``:
``tuple(sorted(set(layers)))``); the subprocess form serves in the dtype vLLM's
``--dtype`` picks (``auto``: the config's, float32 downcast to the GPU's first
supported dtype) on a GPU of compute capability ``FAKE_VLLM_CAPABILITY`` (default
9.0, an H200), and refuses MLA verifiers with the file connector, as vLLM does.

Fault injection (``faults`` dict, or JSON in ``FAKE_VLLM_FAULTS`` for the
subprocess form), keyed by the prompt's first token or ``"*"``:
``http_500`` (int: answer 500 that many times), ``mismatch`` (int: that many
answers with wrong prompt_token_ids), ``bad_file_tokens`` (int: files with wrong
token_ids), ``hold_lock`` (never release the lock), ``write_delay`` (seconds).

Used in-process (``FakeVllm(...).start()``) or as ``vllm.entrypoints.cli.main``
through the shim package that :func:`install_vllm_shim` writes.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def synthetic_hidden_states(
    prompt: list[int], layer_ids: list[int], hidden: int, dtype: str = "float32"
):
    """Deterministic stand-in values of layers ``layer_ids``, in that slot order (numpy
    only: a fast-starting server)."""
    import ml_dtypes
    import numpy as np

    t = np.asarray(prompt, dtype=np.float32)[:, None, None]
    k = np.asarray(layer_ids, dtype=np.float32)[None, :, None]
    h = np.arange(hidden, dtype=np.float32)[None, None, :]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return np.sin(0.01 * t + 0.1 * k + 0.001 * h).astype(np_dtype)


def vllm_dtype(requested: str, config: dict, capability: float) -> str:
    """vLLM 0.33.0's model dtype (config/model.py ``_get_and_verify_dtype``,
    platforms/cuda.py ``supported_dtypes``) for a config.json that names its dtype."""
    names = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16"}
    names |= {"float": "float32", "float32": "float32"}
    if requested.lower() != "auto":
        return names[requested.lower()]
    if capability >= 8.0:
        supported = ["bfloat16", "float16", "float32"]
    elif capability >= 6.0:
        supported = ["float16", "float32"]
    else:
        supported = ["float32"]
    own = config.get("dtype") or config.get("torch_dtype") or "float32"
    own = supported[0] if own == "float32" else own
    return own if own in supported else supported[0]


def is_mla(config: dict) -> bool:
    """The MLA verifiers the tests use (vLLM's ``is_deepseek_mla``, abridged)."""
    text = config.get("text_config") or config
    mla_types = ("deepseek_v2", "deepseek_v3", "kimi_k2")
    return text.get("model_type") in mla_types and text.get("kv_lora_rank") is not None


class FakeVllm:
    def __init__(
        self,
        model: str,
        served_name: str,
        layer_ids: list[int],
        storage: str | Path,
        extractor=None,
        faults: dict | None = None,
        port: int = 0,
        write_delay: float = 0.2,
        synthetic_hidden_size: int | None = None,
        synthetic_dtype: str = "float32",
    ):
        self.model, self.served_name = model, served_name
        # vLLM captures the aux layers in ascending order, whatever the config lists
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"duplicate layer ids {layer_ids} (vLLM's buffer would not fit)")
        self.layer_ids, self.storage = sorted(layer_ids), Path(storage)
        self.synthetic_dtype = synthetic_dtype
        self.faults = faults or {}
        self.write_delay = write_delay
        self.counts: dict[tuple, int] = {}
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self._ids = itertools.count()
        self.held_locks: list[int] = []
        self.writers: list[threading.Thread] = []
        self.synthetic_hidden_size = synthetic_hidden_size
        if synthetic_hidden_size is None and (
            extractor is None or extractor.layer_ids != self.layer_ids
        ):
            from launch.hf_extract import HFExtractor

            n = None if extractor is None else extractor.num_hidden_layers
            targets = [k for k in self.layer_ids if k != n] if n else self.layer_ids[:-1]
            extractor = HFExtractor(model, targets, device="cpu")
            assert extractor.layer_ids == self.layer_ids, (extractor.layer_ids, self.layer_ids)
        self.extractor = extractor
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"

    # fault bookkeeping -------------------------------------------------------------
    def _fault(self, name: str, prompt: list[int]):
        for key in (str(prompt[0]) if prompt else "", "*"):
            spec = self.faults.get(key, {})
            if name in spec:
                return spec[name]
        return None

    def _take(self, name: str, prompt: list[int]) -> bool:
        """Consume one occurrence of an int-valued fault for this prompt."""
        n = self._fault(name, prompt)
        if not n:
            return False
        with self.lock:
            k = (name, tuple(prompt))
            used = self.counts.get(k, 0)
            if used >= n:
                return False
            self.counts[k] = used + 1
            return True

    # HTTP ----------------------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, payload) -> None:
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path == "/health":
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/v1/models":
                    self._send(
                        200,
                        {
                            "object": "list",
                            "data": [
                                {
                                    "id": server.served_name,
                                    "object": "model",
                                    "owned_by": "vllm",
                                    "root": server.model,
                                }
                            ],
                        },
                    )
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                server.requests.append(body)
                code, payload = server.complete(body)
                self._send(code, payload)

        return Handler

    def complete(self, body: dict) -> tuple[int, dict]:
        if body.get("model") != self.served_name:
            return 404, {
                "error": {
                    "message": f"The model `{body.get('model')}` does not exist.",
                    "type": "NotFoundError",
                    "code": 404,
                }
            }
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return 400, {"error": {"message": "prompt must be a list of token ids"}}
        if self._take("http_500", prompt):
            return 500, {"error": {"message": "EngineCore encountered an issue", "code": 500}}
        req_id = f"cmpl-{next(self._ids):06d}"
        path = self.storage / f"{req_id}.safetensors"
        self.storage.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        import numpy as np

        if self.synthetic_hidden_size:
            hs = synthetic_hidden_states(
                prompt, self.layer_ids, self.synthetic_hidden_size, self.synthetic_dtype
            )
        else:
            with self.lock:  # HFExtractor's hooks are not thread-safe
                hs = self.extractor.extract([prompt])[0]
        token_ids = np.asarray(prompt, dtype=np.int64)
        if self._take("bad_file_tokens", prompt):
            token_ids = token_ids.copy()
            token_ids[-1] = (token_ids[-1] + 1) % 7
        hold = bool(self._fault("hold_lock", prompt))
        delay = self._fault("write_delay", prompt)
        delay = self.write_delay if delay is None else delay

        def write():
            time.sleep(delay)
            try:
                if isinstance(hs, np.ndarray):
                    from safetensors.numpy import save_file

                    save_file({"hidden_states": hs, "token_ids": token_ids}, str(path))
                else:
                    import torch
                    from safetensors.torch import save_file

                    save_file(
                        {
                            "hidden_states": hs.contiguous(),
                            "token_ids": torch.from_numpy(token_ids),
                        },
                        str(path),
                    )
            finally:
                if hold:
                    self.held_locks.append(lock_fd)
                else:
                    os.close(lock_fd)

        t = threading.Thread(target=write, daemon=True)
        t.start()
        self.writers.append(t)
        seen = list(prompt)
        if self._take("mismatch", prompt):
            seen = seen[:-1]
        return 200, {
            "id": req_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_name,
            "choices": [
                {
                    "index": 0,
                    "text": "x",
                    "logprobs": None,
                    "finish_reason": "length",
                    "prompt_token_ids": seen,
                    "token_ids": [0],
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": 1,
                "total_tokens": len(prompt) + 1,
            },
            "kv_transfer_params": {"hidden_states_path": str(path)},
        }

    def start(self) -> FakeVllm:
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self.writers:
            t.join(timeout=5)
        for fd in self.held_locks:
            os.close(fd)
        self.held_locks.clear()


SHIM = """import sys
from tests.launch.fake_vllm import serve_main
sys.exit(serve_main(sys.argv[1:]))
"""


def install_vllm_shim(root: Path) -> Path:
    """Write a package ``vllm.entrypoints.cli.main`` under ``root`` that runs this
    stand-in; put ``root`` first on PYTHONPATH to make ``python -m
    vllm.entrypoints.cli.main serve ...`` start it."""
    pkg = root / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(SHIM)
    return root


def serve_main(argv: list[str]) -> int:
    """``serve MODEL --speculative_config J --kv_transfer_config J [--port P]
    [--served-model-name N] [--dtype D] ...`` (unknown vLLM flags are ignored)."""
    assert argv and argv[0] == "serve", argv
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--speculative_config", "--speculative-config", required=True)
    ap.add_argument("--kv_transfer_config", "--kv-transfer-config", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--dtype", default="auto")
    args, _unknown = ap.parse_known_args(argv[1:])
    spec = json.loads(args.speculative_config)
    kv = json.loads(args.kv_transfer_config)
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1, spec
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    faults = json.loads(os.environ.get("FAKE_VLLM_FAULTS", "{}"))
    config = json.loads((Path(args.model) / "config.json").read_text())
    if is_mla(config):  # vLLM's file connector, once the model has loaded
        raise ValueError(
            "Could not uniquely identify the extract-hidden-states KV cache group "
            "(MLA verifiers are unsupported)."
        )
    dtype = vllm_dtype(args.dtype, config, float(os.environ.get("FAKE_VLLM_CAPABILITY", "9.0")))
    srv = FakeVllm(
        args.model,
        args.served_model_name or args.model,
        layer_ids,
        kv["kv_connector_extra_config"]["shared_storage_path"],
        faults=faults,
        port=args.port,
        write_delay=0.05,
        synthetic_hidden_size=int(config["hidden_size"]),
        synthetic_dtype=dtype,
    )
    print(
        f"fake vllm serving {args.model} on {srv.base_url} layers {srv.layer_ids} dtype {dtype}",
        flush=True,
    )
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
