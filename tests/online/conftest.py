"""Fixtures for the online tests: an extractor server over known hidden states, with
fault injection, speaking the real protocol (launch/serve_hidden_states.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_jax.data.online.mooncake import MooncakeHiddenStates
from launch.mooncake_master import start_master
from launch.serve_hidden_states import FilePublisher, HiddenStatesServer, MooncakePublisher
from tests.online.store_fake import FakeMooncakeStore

SERVED = "tiny-verifier"
MASTER_LOG = pytest.StashKey[Path]()


@pytest.fixture(scope="module")
def mooncake_master(request, tmp_path_factory):
    """A real ``mooncake_master`` for the module: its ``host:port``. It logs to a file,
    whose tail is added to the report of a failing test of the module. Close the
    module's store clients before it stops (a client left open pings the stopped
    master for 10 s at exit, logging errors past pytest's capture)."""
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    proc, address = start_master(log)
    request.node.stash[MASTER_LOG] = log
    yield address
    proc.terminate()
    proc.wait(timeout=10)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    module = item.getparent(pytest.Module)
    log = module.stash.get(MASTER_LOG, None) if module is not None else None
    if report.failed and log is not None and log.exists():
        tail = log.read_text(errors="replace").splitlines()[-30:]
        report.sections.append(("mooncake_master log (last 30 lines)", "\n".join(tail)))
    return report


class LookupExtractor:
    """Serves the hidden states a TinyData wrote to files, by prompt."""

    def __init__(self, data):
        self.table = {tuple(int(t) for t in ids): h for ids, h in zip(data.input_ids, data.hidden)}
        self.layer_ids = list(range(data.n_aux + 1))
        self.model_name = "tiny"

    def extract(self, rows):
        out = []
        for r in rows:
            h = self.table[tuple(int(t) for t in r)]
            out.append(
                torch.from_numpy(np.ascontiguousarray(h).view(np.int16)).view(torch.bfloat16)
            )
        return out


class FaultyServer(HiddenStatesServer):
    """``faults[(kind, row)] = n``: the first n requests for dataset row ``row`` fail with
    ``kind``; row ``"*"`` applies to every row. Kinds: ``http_500``, ``slow`` (answer
    after ``slow_seconds``), ``mismatch`` (wrong prompt_token_ids), ``bad_tokens``
    (stored token_ids differ), ``nan`` (stored hidden states hold a NaN),
    ``corrupt`` (a stored Mooncake object is damaged after publishing)."""

    def __init__(self, data, publisher, store=None, slow_seconds=1.0, **kw):
        super().__init__(LookupExtractor(data), SERVED, publisher, **kw)
        self.rows = {tuple(int(t) for t in ids): i for i, ids in enumerate(data.input_ids)}
        self.faults: dict = {}
        self.used = Counter()
        self.requests = Counter()  # row -> completion requests
        self.store = store
        self.slow_seconds = slow_seconds
        self._fault_lock = threading.Lock()

    def _take(self, kind, row) -> bool:
        with self._fault_lock:
            for key in ((kind, row), (kind, "*")):
                n = self.faults.get(key, 0)
                if n == -1 or self.used[key] < n:
                    self.used[key] += 1
                    return True
        return False

    def _row(self, prompt):
        return self.rows.get(tuple(int(t) for t in prompt))

    def complete(self, body):
        row = self._row(body.get("prompt") or [])
        with self._fault_lock:
            self.requests[row] += 1
        if self._take("http_500", row):
            return 500, {"error": {"message": "EngineCore encountered an issue", "code": 500}}
        if self._take("slow", row):
            time.sleep(self.slow_seconds)
        status, payload = super().complete(body)
        if status == 200 and self._take("mismatch", row):
            payload["choices"][0]["prompt_token_ids"] = payload["choices"][0]["prompt_token_ids"][
                :-1
            ]
        if status == 200 and self._take("corrupt", row):
            handle = payload["kv_transfer_params"]["handle"]
            key = handle if handle in self.store.objects else f"{handle}:hidden_states"
            self.store.corrupt(key, at=3)
        return status, payload

    def publish(self, req_id, hidden_states, token_ids):
        row = self._row(token_ids.tolist())
        if self._take("bad_tokens", row):
            token_ids = token_ids.clone()
            token_ids[-1] += 1
        if self._take("nan", row):
            hidden_states = hidden_states.clone()
            hidden_states[0, 0, 0] = float("nan")
        return super().publish(req_id, hidden_states, token_ids)


@pytest.fixture
def file_server(tmp_path):
    servers = []

    def make(data, **kw):
        srv = FaultyServer(data, FilePublisher(tmp_path / "staging"), **kw).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def mooncake_server():
    servers = []

    def make(data, fmt="per-tensor", **kw):
        store = FakeMooncakeStore()
        srv = FaultyServer(
            data, MooncakePublisher(MooncakeHiddenStates(store), fmt), store=store, **kw
        ).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()
