"""launch/serve_hidden_states.py: a real extractor server (vLLM's protocol, HF backend).

Files (with the .lock protocol) and Mooncake samples (both wire formats, read back by
our consumer and by hs_connectors' reference consumer) must hold exactly what
``HFExtractor.extract`` returns for a one-row forward."""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_jax.data.online.client import ExtractorClient
from dspark_jax.data.online.mooncake import MooncakeHiddenStates
from launch.hs_files import save_hidden_states
from launch.serve_hidden_states import (
    FilePublisher,
    HiddenStatesServer,
    MooncakePublisher,
    to_numpy,
)
from launch.vllm_backend import VllmClient, wait_for_lock
from tests.online.store_fake import FakeMooncakeStore

from .conftest import DEMO_TARGET_LAYERS, REPO

SERVED = "demo-verifier"
PROMPTS = [[1, 17, 250, 3, 99, 4000, 12], [5, 6, 7], list(range(100, 141))]
KEY_RE = re.compile(r"^cmpl-[0-9a-f]{32}$")


def _post(url: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, resp.read()


def _body(prompt, model=SERVED) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 1, "return_token_ids": True}


@pytest.fixture
def serve(extractor, verifier_path):
    servers = []

    def make(publisher, cls=HiddenStatesServer, **kw):
        srv = cls(extractor, SERVED, publisher, model=verifier_path, **kw).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def reference(extractor):
    """One-row HF outputs and the greedy next token of a plain full-model forward."""
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            hs = extractor.extract([p])[0]
            logits = extractor.model(input_ids=torch.tensor([p])).logits
            out.append((hs, int(logits[0, -1].float().argmax())))
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


# --------------------------------------------------------------------------------------
# file backend
# --------------------------------------------------------------------------------------


def test_file_backend_files_equal_hf_one_row(tmp_path, serve, extractor, reference):
    srv = serve(FilePublisher(tmp_path / "stage"))
    client = VllmClient(srv.base_url + "/v1", SERVED, retry_backoff=0.01, lock_timeout=10)
    assert client.check_model() == SERVED
    out, ref_dir = tmp_path / "out", tmp_path / "ref"
    out.mkdir()
    ref_dir.mkdir()
    # several requests in flight: forwards are serialized, answers stay per request
    jobs = list(enumerate(PROMPTS * 2))
    with cf.ThreadPoolExecutor(4) as pool:
        paths = list(
            pool.map(
                lambda j: client.fetch(
                    j[0],
                    j[1],
                    out,
                    num_slots=len(extractor.layer_ids),
                    hidden_size=extractor.hidden_size,
                    dtype="bfloat16",
                ),
                jobs,
            )
        )
    for (i, ids), path in zip(jobs, paths):
        want = save_hidden_states(
            ref_dir / f"hs_{i}.safetensors", reference[i % len(PROMPTS)][0], ids
        )
        # byte-identical to launch.extract_hidden_states --backend hf --batch-size 1
        assert path.read_bytes() == want.read_bytes(), i
    # the client took every lock, removed the .lock files and moved the files away
    assert sorted(os.listdir(tmp_path / "stage")) == []


def test_file_backend_lock_held_until_written(tmp_path, serve, extractor, reference):
    gate = threading.Event()

    class SlowWriter(FilePublisher):
        def write(self, path, tensors):
            assert gate.wait(30)
            super().write(path, tensors)

    srv = serve(SlowWriter(tmp_path / "stage"))
    code, res = _post(srv.base_url + "/v1/completions", _body(PROMPTS[0]))
    assert code == 200, res
    assert KEY_RE.match(res["id"])
    choice = res["choices"][0]
    assert choice["prompt_token_ids"] == PROMPTS[0]
    assert choice["token_ids"] == [reference[0][1]]  # the honest greedy next token
    assert choice["finish_reason"] == "length"
    assert res["object"] == "text_completion" and res["model"] == SERVED
    assert res["usage"] == {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
    path = Path(res["kv_transfer_params"]["hidden_states_path"])
    assert path.is_absolute() and path.parent == (tmp_path / "stage").resolve()
    assert path.name == res["id"] + ".safetensors"
    lock = Path(str(path) + ".lock")
    # answered before writing, with the lock already held
    assert lock.exists() and not path.exists()
    fd = os.open(lock, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    with pytest.raises(TimeoutError):
        wait_for_lock(lock, timeout=0.2)
    gate.set()
    wait_for_lock(lock, timeout=10)
    assert not lock.exists()
    from safetensors.torch import load_file

    got = load_file(path)
    assert got["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(got["hidden_states"], reference[0][0])
    assert got["token_ids"].dtype == torch.long
    assert got["token_ids"].tolist() == PROMPTS[0]
    path.unlink()


def test_greedy_token_of_every_prompt(tmp_path, serve, reference):
    srv = serve(FilePublisher(tmp_path / "stage"))
    client = ExtractorClient(srv.base_url + "/v1", SERVED)
    for p, (_, nxt) in zip(PROMPTS, reference):
        res = client.request(p)
        client.check_prompt(res, p)
        assert res["choices"][0]["token_ids"] == [nxt]
        wait_for_lock(res["kv_transfer_params"]["hidden_states_path"] + ".lock", timeout=10)
    srv.stop()  # waits for the writers; removes nothing it handed out
    assert len(list((tmp_path / "stage").glob("*.safetensors"))) == len(PROMPTS)


def test_greedy_token_without_last_layer_and_without_model_call(
    tmp_path, serve, extractor, verifier_path, reference
):
    from launch.hf_extract import HFExtractor

    # layer N not stored: the token comes from the decoder's (post-norm) output
    aux_only = HFExtractor(verifier_path, [1, 2], include_last_layer=False, device="cpu")
    assert aux_only.layer_ids == [1, 2]
    srv = HiddenStatesServer(aux_only, SERVED, FilePublisher(tmp_path / "a")).start()
    try:
        res = ExtractorClient(srv.base_url + "/v1", SERVED).request(PROMPTS[2])
        assert res["choices"][0]["token_ids"] == [reference[2][1]]
    finally:
        srv.stop()

    # an extract override that bypasses the model: final norm applied to slot N
    class Canned(HiddenStatesServer):
        def extract(self, prompt):
            return reference[PROMPTS.index(list(prompt))][0]

    srv = serve(FilePublisher(tmp_path / "b"), cls=Canned)
    for p, (_, nxt) in zip(PROMPTS, reference):
        res = ExtractorClient(srv.base_url + "/v1", SERVED).request(p)
        assert res["choices"][0]["token_ids"] == [nxt]


# --------------------------------------------------------------------------------------
# mooncake backend
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["packed", "per-tensor"])
def test_mooncake_formats_round_trip(serve, reference, fmt):
    store = FakeMooncakeStore()
    srv = serve(MooncakePublisher(MooncakeHiddenStates(store), fmt, writer_threads=2))
    client = ExtractorClient(srv.base_url + "/v1", SERVED)
    consumer = MooncakeHiddenStates(store)
    for p, (hs, nxt) in zip(PROMPTS, reference):
        res = client.request(p)
        client.check_prompt(res, p)
        assert res["choices"][0]["token_ids"] == [nxt]
        params = client.transfer_params(res)
        assert KEY_RE.match(params["handle"]) and params["handle"] == res["id"]
        if fmt == "packed":
            assert params["version"] == 1 and params["tensors"]["hidden_states"]["dtype"] == (
                "torch.bfloat16"
            )
            assert params["metadata"]["num_tokens"] == len(p)
        else:
            assert params == {"handle": res["id"]}
        got_hs, got_tok = consumer.get(params, timeout=5)
        want = to_numpy(hs)
        assert got_hs.dtype == want.dtype and got_hs.shape == tuple(hs.shape)
        assert np.array_equal(_bits(got_hs), _bits(want))
        assert got_tok.dtype == np.int64 and got_tok.tolist() == p
        consumer.delete(params)
    assert store.objects == {}


@pytest.mark.reference
def test_reference_consumer_reads_packed(serve, reference):
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    store = FakeMooncakeStore()
    srv = serve(MooncakePublisher(MooncakeHiddenStates(store), "packed"))
    client = ExtractorClient(srv.base_url + "/v1", SERVED)
    ref = MooncakeHiddenStatesStore(MooncakeStoreConfig())
    ref._store = store  # instead of setup(): the fake store
    for p, (hs, _) in zip(PROMPTS, reference):
        manifest = client.transfer_params(client.request(p))
        got = ref.get_sample(manifest, timeout=5)
        assert set(got) == {"hidden_states", "token_ids"}
        assert got["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_states"], hs)
        assert got["token_ids"].dtype == torch.long and got["token_ids"].tolist() == p
        ref.delete_sample(manifest["handle"])
    assert store.objects == {}


def test_mooncake_publish_failure_marks_error_and_answers_500(serve):
    class FailingStore(FakeMooncakeStore):
        def put_from(self, key, ptr, size):
            return -800

    store = FailingStore()
    srv = serve(MooncakePublisher(MooncakeHiddenStates(store), "per-tensor"))
    code, res = _post(srv.base_url + "/v1/completions", _body([3, 4, 5]))
    assert code == 500 and res["error"]["code"] == 500
    assert "publishing" in res["error"]["message"]
    keys = list(store.objects)
    assert len(keys) == 1 and keys[0].endswith(":error")
    assert KEY_RE.match(keys[0].removesuffix(":error"))
    assert "status -800" in json.loads(store.objects[keys[0]])["error"]


# --------------------------------------------------------------------------------------
# errors and listing
# --------------------------------------------------------------------------------------


def test_errors_models_and_health(tmp_path, serve, verifier_path):
    srv = serve(FilePublisher(tmp_path / "stage"))
    url = srv.base_url + "/v1/completions"
    assert _get(srv.base_url + "/health")[0] == 200
    code, raw = _get(srv.base_url + "/v1/models")
    models = json.loads(raw)
    assert code == 200 and models["object"] == "list"
    entry = models["data"][0]
    assert {k: entry[k] for k in ("id", "object", "root", "owned_by")} == {
        "id": SERVED,
        "object": "model",
        "root": verifier_path,
        "owned_by": "dspark-jax",
    }
    # the client also accepts the root path as the model name
    assert ExtractorClient(srv.base_url + "/v1", verifier_path).check_model() == SERVED

    code, res = _post(url, _body([1, 2], model="other"))
    assert code == 404
    assert set(res["error"]) >= {"message", "type", "code"} and res["error"]["code"] == 404
    assert "other" in res["error"]["message"]
    for bad in (["a", "b"], [1.5], [], [True, 2], "hello", [[1, 2]], [-1], [4096], [1] * 4097):
        code, res = _post(url, _body(bad))
        assert code == 400, bad
        assert res["error"]["type"] == "BadRequestError" and res["error"]["code"] == 400
    code, res = _post(url, {**_body([1, 2]), "max_tokens": 0})
    assert code == 400
    code, res = _post(url, None, raw=b"{not json")
    assert code == 400
    code, res = _post(srv.base_url + "/v1/chat/completions", _body([1, 2]))
    assert code == 404
    assert os.listdir(tmp_path / "stage") == []  # nothing published for refused requests


def test_extraction_failure_answers_500(tmp_path, serve):
    class Broken(HiddenStatesServer):
        def extract(self, prompt):
            raise RuntimeError("CUDA out of memory (injected)")

    srv = serve(FilePublisher(tmp_path / "stage"), cls=Broken)
    code, res = _post(srv.base_url + "/v1/completions", _body([1, 2, 3]))
    assert code == 500 and "injected" in res["error"]["message"]
    assert res["error"]["type"] == "InternalServerError"
    assert os.listdir(tmp_path / "stage") == []


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def test_cli_file_backend_round_trip_and_sigterm(tmp_path, extractor, reference):
    stage, out = tmp_path / "stage", tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "launch.serve_hidden_states",
        "configs/demo/verifier",
        "--target-layer-ids",
        *map(str, DEMO_TARGET_LAYERS),
        "--port",
        "0",
        "--hidden-states-backend",
        "file",
        "--hidden-states-path",
        str(stage),
        "--device",
        "cpu",
        "--threads",
        str(torch.get_num_threads()),
        "--compute-dtype",  # the reference answers are the bf16 forward's
        "bfloat16",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def pump():
        for line in proc.stdout:
            log.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline, base = time.monotonic() + 120, None
        while base is None:
            assert proc.poll() is None, "".join(log)
            assert time.monotonic() < deadline, "".join(log)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            m = re.search(
                r"serving configs/demo/verifier as configs/demo/verifier on "
                r"(http://127\.0\.0\.1:\d+)/v1 \(layers \[1, 2, 3, 4\], backend file",
                line,
            )
            base = m and m.group(1)
        assert _get(base + "/health")[0] == 200
        client = VllmClient(
            base + "/v1", "configs/demo/verifier", retry_backoff=0.01, lock_timeout=10
        )
        client.check_model()
        p = PROMPTS[0]
        path = client.fetch(
            0, p, out, num_slots=4, hidden_size=extractor.hidden_size, dtype="bfloat16"
        )
        want = save_hidden_states(tmp_path / "ref.safetensors", reference[0][0], p)
        assert path.read_bytes() == want.read_bytes()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serves_layers_ascending_in_vllms_dtype(tmp_path, verifier_path, reference):
    """As vLLM 0.33.0: ids given out of order are served ascending, and a float32 config
    with --dtype auto is served in bf16 on compute capability >= 8.0 (so the answers equal
    those of the bf16 demo verifier)."""
    from safetensors.torch import load_file

    from launch.serve_hidden_states import build_server, parse_args

    model = tmp_path / "f32-verifier"
    model.mkdir()
    config = json.loads((Path(verifier_path) / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / name).symlink_to(Path(verifier_path) / name)
    args = parse_args(
        [str(model), "--target-layer-ids", "3", "1", "2", "--port", "0", "--device", "cpu"]
        + ["--hidden-states-backend", "file", "--hidden-states-path", str(tmp_path / "stage")]
        + ["--compute-capability", "9.0", "--compute-dtype", "bfloat16"]
    )
    srv = build_server(args).start()
    try:
        assert "(layers [1, 2, 3, 4], backend file" in srv.describe()
        assert srv.describe().endswith(", attention sdpa)")  # Qwen3: transformers' default
        client = VllmClient(srv.base_url + "/v1", str(model), retry_backoff=0.01, lock_timeout=10)
        path = client.fetch(
            0, PROMPTS[0], tmp_path, num_slots=4, hidden_size=None, dtype="bfloat16"
        )
    finally:
        srv.stop()
    assert torch.equal(load_file(path)["hidden_states"], reference[0][0])
