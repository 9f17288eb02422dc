"""vLLM hidden-state extraction: server command, launcher, and the client.

The server is ``vllm serve`` with the ``extract_hidden_states`` speculative method
and a hidden-states KV connector (docs/formats.md, "Extractor server"):

    --speculative_config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [ids..., N]}}}'
    --kv_transfer_config '{"kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": DIR}}'

Per row the client sends an OpenAI completions request (``prompt`` = the row's
token ids, ``max_tokens=1``, ``return_token_ids=true``). vLLM answers with
``choices[0].prompt_token_ids`` and ``kv_transfer_params.hidden_states_path`` (a
file ``DIR/<request id>.safetensors`` holding ``hidden_states`` [T, n, H] and
``token_ids``). The connector creates ``<path>.lock`` and holds an exclusive
``flock`` on it until the file is written; the client takes the lock (waiting
up to a timeout), removes the lock file, moves the file next to its final name,
validates it and renames it to ``hs_{i}.safetensors``.

Failures: connection errors, timeouts, HTTP 408/429/5xx are retried
``max_retries`` times with exponential backoff; an invalid answer (wrong
``prompt_token_ids``, missing ``kv_transfer_params``) or an invalid file (token
mismatch, wrong shape, non-finite values, lock timeout) repeats the whole round
trip ``validation_retries`` times. A sample that still fails raises
:class:`SampleError`, whose message names the sample and the request.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dspark_jax.data.online.client import ExtractorClient, transfer_handle
from dspark_jax.data.online.http import HTTPStatusError, InvalidResponseError, get_status
from dspark_jax.data.online.transport import wait_for_lock
from launch.hs_files import (
    HiddenStatesError,
    commit_file,
    hs_path,
    load_and_check,
    partial_path,
)

log = logging.getLogger("launch.vllm")

FILE_CONNECTOR = "ExampleHiddenStatesConnector"
FP8_CONNECTOR = "FP8HiddenStatesConnector"
# connectors that write files (the fp8 one subclasses the file one); they refuse MLA
FILE_CONNECTORS = (FILE_CONNECTOR, FP8_CONNECTOR)


class SampleError(RuntimeError):
    """A sample that could not be extracted after all retries."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


# --------------------------------------------------------------------------------------
# server command
# --------------------------------------------------------------------------------------


def speculative_config(layer_ids: Sequence[int]) -> dict:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def file_kv_transfer_config(shared_storage_path: str | Path, fp8: bool = False) -> dict:
    cfg = {
        "kv_connector": FP8_CONNECTOR if fp8 else FILE_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(shared_storage_path)},
    }
    if fp8:
        cfg["kv_connector_module_path"] = "hs_connectors.fp8_hidden_states_connector"
    return cfg


def serve_command(
    model: str,
    layer_ids: Sequence[int],
    kv_transfer_config: dict,
    vllm_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """``python -m vllm.entrypoints.cli.main serve MODEL --speculative_config ... `` as
    speculators' ``scripts/launch_vllm.py`` builds it."""
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--speculative_config",
        json.dumps(speculative_config(layer_ids)),
        "--kv_transfer_config",
        json.dumps(kv_transfer_config),
        *vllm_args,
    ]


def option_value(args: Sequence[str], name: str) -> str | None:
    """Value of ``--name X`` or ``--name=X`` in a vLLM argument list (also the
    ``_`` spelling)."""
    names = {name, name.replace("-", "_")}
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            return args[i + 1]
        for n in names:
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def set_option(args: Sequence[str], name: str, value: str) -> list[str]:
    """``args`` with ``--name value``: any ``--name X`` / ``--name=X`` (also the ``_``
    spelling) replaced in place, else appended."""
    names = {name, name.replace("-", "_")}
    out: list[str] = []
    placed, skip = False, False
    for a in args:
        if skip:
            skip = False
            continue
        if a in names or any(a.startswith(n + "=") for n in names):
            skip = a in names
            if not placed:
                out += [name, value]
                placed = True
            continue
        out.append(a)
    return out if placed else [*out, name, value]


class VllmServer:
    """Run a server command, wait for ``GET /health`` to answer 200, stop it on exit."""

    def __init__(
        self,
        cmd: Sequence[str],
        base_url: str,
        log_path: str | Path,
        health_timeout: float = 1800.0,
        poll: float = 2.0,
        env: dict | None = None,
    ):
        self.cmd, self.base_url = list(cmd), base_url.rstrip("/")
        self.log_path, self.health_timeout, self.poll = Path(log_path), health_timeout, poll
        self.env = env
        self.proc: subprocess.Popen | None = None

    def _tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting: %s", " ".join(self.cmd))
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        deadline = time.monotonic() + self.health_timeout
        url = self.base_url + "/health"
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self._close()
                raise RuntimeError(
                    f"vLLM server exited with status {code} before answering "
                    f"{url}; last lines of {self.log_path}:\n{self._tail()}"
                )
            if get_status(url, timeout=5.0) == 200:
                log.info("server ready at %s", self.base_url)
                return self
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise TimeoutError(
                    f"vLLM server did not answer {url} within "
                    f"{self.health_timeout:.0f}s; see {self.log_path}"
                )
            time.sleep(self.poll)

    def _close(self):
        try:
            self._log.close()
        except Exception:  # noqa: BLE001
            pass

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._close()


def wait_for_server(base_url: str, timeout: float, poll: float = 2.0) -> None:
    url = base_url.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout
    while get_status(url) != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from {url} within {timeout:.0f}s")
        time.sleep(poll)


# --------------------------------------------------------------------------------------
# client
# --------------------------------------------------------------------------------------


class VllmClient(ExtractorClient):
    """The offline extraction client: one row -> ``hs_{i}.safetensors`` through the
    file connector (protocol in dspark_jax/data/online/client.py)."""

    def __init__(
        self,
        endpoint: str,
        model: str | None = None,
        *,
        request_timeout: float = 120.0,
        max_retries: int = 3,
        retry_backoff: float = 2.0,
        validation_retries: int = 2,
        lock_timeout: float = 60.0,
    ):
        super().__init__(
            endpoint,
            model,
            request_timeout=request_timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
        )
        self.validation_retries = validation_retries
        self.lock_timeout = lock_timeout

    @staticmethod
    def hidden_states_path(res: dict) -> str:
        return transfer_handle(ExtractorClient.transfer_params(res))

    def discard(self, path: Path) -> None:
        """Delete a file the server wrote for a rejected answer, once its writer is done."""
        lock = Path(str(path) + ".lock")
        if lock.exists():
            try:
                wait_for_lock(lock, timeout=self.lock_timeout)
            except (TimeoutError, OSError) as e:
                log.warning("could not remove %s: %s", path, e)
                return
        path.unlink(missing_ok=True)

    def fetch(
        self,
        index: int,
        ids: Sequence[int],
        out_dir: str | Path,
        *,
        num_slots: int | None,
        hidden_size: int | None,
        dtype: str | None,
    ) -> Path:
        """Extract row ``index`` into ``out_dir/hs_{index}.safetensors``."""
        final = hs_path(out_dir, index)
        attempts = self.validation_retries + 1
        last: Exception | None = None
        for attempt in range(1, attempts + 1):
            staged: Path | None = None
            lock_timed_out = False
            tmp = partial_path(final)
            try:
                res = self.request(ids)
                staged = Path(self.hidden_states_path(res))
                self.check_prompt(res, ids)
                lock = Path(str(staged) + ".lock")
                if lock.exists():
                    wait_for_lock(lock, timeout=self.lock_timeout)
                _move(staged, tmp)
                staged = None
                load_and_check(tmp, ids, num_slots=num_slots, hidden_size=hidden_size, dtype=dtype)
                commit_file(tmp, final)
                return final
            except HTTPStatusError as e:
                raise SampleError(
                    index, f"sample {index} ({final.name}): {self.describe(ids)} failed: {e}"
                ) from e
            except (InvalidResponseError, HiddenStatesError, TimeoutError, OSError) as e:
                last = e
                lock_timed_out = isinstance(e, TimeoutError)
                if attempt < attempts:
                    log.warning(
                        "sample %d: %s -> %s (round trip %d/%d, retrying)",
                        index,
                        self.describe(ids),
                        e,
                        attempt,
                        attempts,
                    )
            finally:
                tmp.unlink(missing_ok=True)
                if staged is not None and not lock_timed_out:  # (its writer still holds it)
                    self.discard(staged)
        raise SampleError(
            index,
            f"sample {index} ({final.name}): {self.describe(ids)} failed "
            f"after {attempts} round trip(s): {type(last).__name__}: {last}",
        )


def _move(src: Path, dst: Path) -> None:
    """Rename, or copy + delete across filesystems (the copy target is a temporary
    name, so an interrupted copy never shows under a final name)."""
    try:
        os.replace(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.copyfile(src, dst)
        src.unlink()
