"""--on-missing generate in the data pipeline: batches generated through a live
extractor (launch/serve_hidden_states.py on 127.0.0.1, file and Mooncake transports)
equal the offline ones; faults are retried, counted or stop the run as the flags say;
no sample is consumed twice or left behind."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dspark_jax.data.hs_names import hs_path
from dspark_jax.data.online.mooncake import MooncakeConfig
from dspark_jax.data.online.source import GenerationError, OnlineSettings, OnlineSource
from dspark_jax.data.online.transport import FileTransport, MooncakeTransport
from dspark_jax.data.pipeline import PackedData
from tests.data.conftest import make_tiny_data
from tests.online.conftest import SERVED

N_DOCS = 24


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("online"), n_docs=N_DOCS, max_len=30)


def source(server, transport=None, **settings) -> OnlineSource:
    kw = {
        "endpoint": server.base_url + "/v1",
        "model": SERVED,
        "request_timeout": 5.0,
        "max_retries": 2,
        "retry_backoff": 0.01,
        "generation_validation_retries": 2,
        "max_consecutive_generation_failures": 5,
        "requests_in_flight": 3,
    }
    kw.update(settings)
    if transport is None:
        transport = (
            MooncakeTransport(MooncakeConfig(), store_factory=lambda: server.store)
            if server.store is not None
            else FileTransport()
        )
    return OnlineSource(OnlineSettings(**kw), transport)


def batches(data, hidden_states_path, *, on_missing="raise", online=None, epochs=1,
            num_workers=0, **kw):  # fmt: skip
    packed = PackedData(
        data.data_path,
        hidden_states_path,
        **data.kwargs(rows_per_process=2, train_data_ratio=1.0, on_missing=on_missing,
                      online=online, hidden_states_dtype="bfloat16", **kw),
    )  # fmt: skip
    it = packed.train_iterator(num_epochs=epochs, num_workers=num_workers)
    out = list(it)
    it.close()
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            a, b = np.asarray(g[k]), np.asarray(w[k])
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), k


@pytest.fixture(scope="module")
def offline(data):
    return batches(data, data.hs_path)


def documents(batch_list) -> int:
    """Documents packed into the batches."""
    return sum(int((b["document_ids"].max(axis=1) + 1).sum()) for b in batch_list)


@pytest.mark.parametrize("backend", ["file", "mooncake-packed", "mooncake-per-tensor"])
def test_generated_batches_equal_the_offline_ones(data, offline, tmp_path, file_server,
                                                   mooncake_server, backend):  # fmt: skip
    if backend == "file":
        srv = file_server(data)
    else:
        srv = mooncake_server(data, fmt=backend.removeprefix("mooncake-"))
    online = source(srv)
    got = batches(data, tmp_path / "no_files_here", on_missing="generate", online=online,
                  read_files=backend == "file")  # fmt: skip
    assert_same(got, offline)
    # every document asked for once, delivered, and deleted after use
    assert all(n == 1 for n in srv.requests.values()) and None not in srv.requests
    assert online.stats.generated == len(srv.requests) == documents(offline)
    assert online.stats.failed_round_trips == 0 and online.stats.dropped == 0
    if srv.store is not None:
        assert srv.store.objects == {}
    else:
        assert list((tmp_path / "staging").iterdir()) == []


def test_only_missing_files_are_generated(data, offline, tmp_path, file_server):
    import shutil

    hs = tmp_path / "hs"
    shutil.copytree(data.hs_path, hs)
    for i in (2, 7, 11):
        hs_path(hs, i).unlink()
    srv = file_server(data)
    got = batches(data, hs, on_missing="generate", online=source(srv))
    assert_same(got, offline)
    assert set(srv.requests) == {2, 7, 11}


@pytest.mark.parametrize(
    ("fault", "failed_round_trips"),
    [
        ("http_500", 0),  # retried inside the request (--max-retries)
        ("slow", 0),  # a request timeout: retried inside the request
        ("mismatch", 1),  # wrong prompt_token_ids: the round trip is repeated
        ("bad_tokens", 1),  # the stored token_ids differ from the row
        ("nan", 1),  # non-finite hidden states
        ("corrupt", 1),  # CRC32 mismatch (per-tensor Mooncake)
    ],
)
def test_faults_are_retried_and_the_batches_are_unchanged(
    data, offline, tmp_path, file_server, mooncake_server, fault, failed_round_trips, caplog
):
    srv = mooncake_server(data) if fault == "corrupt" else file_server(data, slow_seconds=1.5)
    srv.faults[(fault, 4)] = 1 if fault != "http_500" else 2
    settings = {"request_timeout": 1.0} if fault == "slow" else {}
    online = source(srv, **settings)
    with caplog.at_level(logging.WARNING):
        got = batches(data, tmp_path / "none", on_missing="generate", online=online,
                      read_files=srv.store is None)  # fmt: skip
    assert_same(got, offline)
    expected_requests = {"http_500": 3, "slow": 2}.get(fault, 2)
    assert srv.requests[4] == expected_requests
    assert online.stats.failed_round_trips == failed_round_trips and online.stats.dropped == 0
    if failed_round_trips:
        assert "hidden-state round trip for dataset row 4 failed (attempt 1/3)" in caplog.text
    else:
        said = "HTTP 500: " if fault == "http_500" else "TimeoutError: timed out; "
        assert said in caplog.text and "(attempt 1/3)" in caplog.text
    srv.stop()  # waits for the request the client gave up on
    left = list((tmp_path / "staging").iterdir()) if srv.store is None else list(srv.store.objects)
    if fault == "slow":
        # the answer the client gave up on: its file is never claimed (as with vLLM)
        assert sorted(p.suffix for p in left) == [".lock", ".safetensors"]
    else:
        assert left == []


def test_a_sample_failing_every_round_trip_is_dropped_and_counted(data, tmp_path, file_server,
                                                                  caplog):  # fmt: skip
    import shutil

    srv = file_server(data)
    srv.faults[("mismatch", 9)] = -1  # always
    online = source(srv)
    with caplog.at_level(logging.WARNING):
        got = batches(data, tmp_path / "none", on_missing="generate", online=online)
    # exactly what the offline pipeline gives with that one file missing and skipped
    hs = tmp_path / "hs"
    shutil.copytree(data.hs_path, hs)
    hs_path(hs, 9).unlink()
    want = batches(data, hs, on_missing="skip")
    assert_same(got, want)
    assert sum(int(b["error_records"].sum()) for b in got) == 1
    assert srv.requests[9] == 3 and online.stats.dropped == 1
    assert (
        "dataset row 9 failed 3 time(s), sample dropped (consecutive failures 1/5)" in caplog.text
    )
    assert list((tmp_path / "staging").iterdir()) == []


def test_the_circuit_breaker_stops_after_consecutive_failures(data, tmp_path, file_server):
    srv = file_server(data)
    srv.faults[("bad_tokens", "*")] = -1
    online = source(srv, generation_validation_retries=1, max_consecutive_generation_failures=3,
                    requests_in_flight=1)  # fmt: skip
    with pytest.raises(GenerationError) as e:
        batches(data, tmp_path / "none", on_missing="generate", online=online)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("hidden-state generation circuit breaker: 3 consecutive samples failed "
                          "(--max-consecutive-generation-failures 3)")  # fmt: skip
    assert "token_ids differ from the prepared dataset's input_ids" in msg
    assert online.stats.dropped == 3 and sum(srv.requests.values()) == 6
    assert list((tmp_path / "staging").iterdir()) == []


def test_a_success_resets_the_consecutive_count(data, file_server):
    srv = file_server(data)
    online = source(srv, max_retries=0, generation_validation_retries=0,
                    max_consecutive_generation_failures=3)  # fmt: skip
    geometry = {"n_aux": data.n_aux, "hidden_size": data.hidden_size}
    for row in (0, 1, 3, 4, 6, 7, 8):
        srv.faults[("http_500", row)] = -1
    results = [online.generate(row, data.input_ids[row], **geometry) for row in range(6)]
    assert [r is None for r in results] == [True, True, False, True, True, False]
    assert online.stats.dropped == 4 and online.stats.generated == 2
    assert online.generate(6, data.input_ids[6], **geometry) is None
    assert online.generate(7, data.input_ids[7], **geometry) is None
    with pytest.raises(GenerationError, match="circuit breaker: 3 consecutive"):
        online.generate(8, data.input_ids[8], **geometry)  # the third in a row
    # tripped: no further requests
    requests = sum(srv.requests.values())
    with pytest.raises(GenerationError, match="circuit breaker"):
        online.generate(9, data.input_ids[9], **geometry)
    assert sum(srv.requests.values()) == requests


def test_dropped_samples_are_counted_in_error_records(data, tmp_path, file_server):
    srv = file_server(data)
    for row in (0, 5, 13):
        srv.faults[("http_500", row)] = -1
    online = source(srv, max_retries=0, generation_validation_retries=0)
    got = batches(data, tmp_path / "none", on_missing="generate", online=online)
    assert online.stats.dropped == 3
    assert sum(int(b["error_records"].sum()) for b in got) == 3


def test_wrong_served_model_stops_at_once(data, tmp_path, file_server):
    srv = file_server(data)
    online = source(srv, model="another/model")
    with pytest.raises(GenerationError, match=r"serves 'tiny-verifier', not 'another/model'; "
                       r"start it with --served-model-name another/model"):  # fmt: skip
        batches(data, tmp_path / "none", on_missing="generate", online=online)
    assert sum(srv.requests.values()) == 0


def test_worker_processes_generate_through_their_own_connection(data, offline, tmp_path,
                                                                file_server):  # fmt: skip
    srv = file_server(data)
    got = batches(data, tmp_path / "none", on_missing="generate", online=source(srv),
                  num_workers=1)  # fmt: skip
    assert_same(got, offline)
    assert all(n == 1 for n in srv.requests.values())
    assert len(srv.requests) == documents(offline)
    assert list((tmp_path / "staging").iterdir()) == []
