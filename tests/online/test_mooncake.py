"""The Mooncake wire formats (dspark_jax/data/online/mooncake.py) against an in-process store
fake, and against hs_connectors 0.9.0's own producer/consumer for the packed format."""

from __future__ import annotations

import json
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from dspark_jax.data.online.mooncake import MooncakeError, MooncakeHiddenStates, packed_manifest
from dspark_jax.data.online.transport import MooncakeTransport, TransportError
from tests.online.store_fake import FakeMooncakeStore


def sample(t=7, slots=3, h=16, seed=0):
    rng = np.random.default_rng(seed)
    hs = rng.standard_normal((t, slots, h)).astype(ml_dtypes.bfloat16)
    return hs, rng.integers(0, 1000, t).astype(np.int64)


@pytest.fixture
def store():
    return FakeMooncakeStore()


@pytest.mark.parametrize("fmt", ["packed", "per_tensor"])
def test_round_trip_then_delete_leaves_the_store_empty(store, fmt):
    hs, tok = sample()
    mc = MooncakeHiddenStates(store)
    params = getattr(mc, f"put_{fmt}")("cmpl-1", hs, tok)
    if fmt == "packed":
        assert (
            params["version"] == 1
            and params["tensors"]["hidden_states"]["dtype"] == "torch.bfloat16"
        )
        assert params["tensors"]["token_ids"]["offset"] % 64 == 0
        assert set(store.objects) == {"cmpl-1"}
    else:
        assert params == {"handle": "cmpl-1"}
        assert set(store.objects) == {"cmpl-1:hidden_states", "cmpl-1:token_ids", "cmpl-1:meta"}
        # meta is written last: its presence marks the sample complete
        assert [k for op, k in store.ops if op.startswith("put")][-1] == "cmpl-1:meta"
    got_hs, got_tok = MooncakeHiddenStates(store).get(params, timeout=1)
    assert got_hs.dtype == hs.dtype and np.array_equal(got_hs.view(np.uint16), hs.view(np.uint16))
    assert np.array_equal(got_tok, tok)
    mc.delete(params)
    assert store.objects == {}
    mc.delete(params)  # deleting twice is fine (missing keys are not an error)


def test_per_tensor_crc_mismatch_is_detected(store):
    hs, tok = sample()
    mc = MooncakeHiddenStates(store)
    params = mc.put_per_tensor("k", hs, tok)
    store.corrupt("k:hidden_states", at=5)
    with pytest.raises(MooncakeError, match=r"CRC32 mismatch for 'k:hidden_states'"):
        mc.get(params, timeout=1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.update(version=2), "manifest version 2"),
        (lambda m: m["metadata"].update(total_aligned_bytes=64), "has .* bytes, expected 64"),
        (lambda m: m["tensors"]["hidden_states"].update(nbytes=8), "out of bounds"),
        (
            lambda m: m["tensors"]["hidden_states"].update(dtype="torch.complex32"),
            "unknown tensor dtype",
        ),
        (lambda m: m["tensors"].pop("token_ids"), "lacks \\['token_ids'\\]"),
    ],
)
def test_bad_packed_manifests_are_refused(store, mutate, message):
    hs, tok = sample()
    manifest = MooncakeHiddenStates(store).put_packed("k", hs, tok)
    mutate(manifest)
    with pytest.raises(MooncakeError, match=message):
        MooncakeHiddenStates(store).get(manifest, timeout=1)


def test_corrupt_meta_and_truncated_tensor(store):
    hs, tok = sample()
    mc = MooncakeHiddenStates(store)
    mc.put_per_tensor("k", hs, tok)
    store.objects["k:meta"] = b"{not json"
    with pytest.raises(MooncakeError, match="corrupt Mooncake meta 'k:meta'"):
        mc.get({"handle": "k"}, timeout=1)
    mc.put_per_tensor("k", hs, tok)
    store.objects["k:token_ids"] = store.objects["k:token_ids"][:-8]
    with pytest.raises(MooncakeError, match="'k:token_ids' has 48 bytes, expected 56"):
        mc.get({"handle": "k"}, timeout=1)


def test_waits_for_a_late_put_and_times_out_on_none(store):
    hs, tok = sample()
    producer = MooncakeHiddenStates(store)
    manifest = packed_manifest("late", hs, tok)
    threading.Timer(0.2, producer.put_packed, ("late", hs, tok)).start()
    t0 = time.monotonic()
    got, _ = MooncakeHiddenStates(store, poll_interval=0.01).get(manifest, timeout=5)
    assert 0.15 < time.monotonic() - t0 < 4 and got.shape == hs.shape
    with pytest.raises(
        MooncakeError, match="timed out after 0.2s waiting for Mooncake key 'never:meta'"
    ):
        MooncakeHiddenStates(store).get({"handle": "never"}, timeout=0.2)


def test_producer_error_marker_fails_fast(store):
    mc = MooncakeHiddenStates(store)
    mc.put_error("k", "CUDA out of memory")
    t0 = time.monotonic()
    with pytest.raises(MooncakeError, match="extractor failed to publish 'k': CUDA out of memory"):
        mc.get({"handle": "k"}, timeout=30)
    assert time.monotonic() - t0 < 5
    mc.delete("k")
    assert store.objects == {}


def test_transport_wraps_errors_and_pickles_without_its_connection(store):
    import pickle

    transport = MooncakeTransport(config=None, store_factory=lambda: store)
    with pytest.raises(TransportError, match="timed out"):
        transport.fetch({"handle": "nothing"}, timeout=0.05)
    clone = pickle.loads(pickle.dumps(MooncakeTransport(config=None)))
    assert clone._hs is None and clone.store_factory is None


def test_staging_buffers_are_registered_and_reused(store):
    hs, tok = sample(t=50)
    mc = MooncakeHiddenStates(store)
    for i in range(3):
        mc.get(mc.put_packed(f"k{i}", hs, tok), timeout=1)
    # one put and one get buffer for this thread, registered once each
    assert len(store.registered) == 2


# ----------------------------------------------------------------- reference interop
@pytest.fixture
def ref_store():
    from hs_connectors import mooncake_store

    return mooncake_store


def _reference(ref_store, store):
    ref = ref_store.MooncakeHiddenStatesStore(ref_store.MooncakeStoreConfig())
    ref._store = store  # the fake in place of MooncakeDistributedStore.setup
    return ref


@pytest.mark.reference
def test_reference_consumer_reads_our_packed_objects(ref_store, store):
    import torch

    hs, tok = sample(t=9, slots=4, h=24, seed=1)
    manifest = MooncakeHiddenStates(store).put_packed("ours", hs, tok)
    got = _reference(ref_store, store).get_sample(json.loads(json.dumps(manifest)), timeout=1)
    assert got["hidden_states"].dtype == torch.bfloat16
    assert np.array_equal(got["hidden_states"].view(torch.int16).numpy(), hs.view(np.int16))
    assert torch.equal(got["token_ids"], torch.from_numpy(tok))


@pytest.mark.reference
def test_we_read_the_reference_producers_packed_objects(ref_store, store):
    import torch

    hs = torch.randn(11, 4, 24).to(torch.bfloat16)
    tok = torch.arange(11, dtype=torch.long) * 7
    spec, total = ref_store.packed_layout(
        {"hidden_states": (list(hs.shape), hs.dtype), "token_ids": (list(tok.shape), tok.dtype)}
    )
    manifest = {
        "handle": "theirs",
        "version": ref_store.VERSION,
        "tensors": spec,
        "metadata": {"num_tokens": 11, "total_aligned_bytes": total, "extract_mode": "prompt_only"},
    }
    ref = _reference(ref_store, store)
    ref.put_sample(manifest, {"hidden_states": hs, "token_ids": tok})
    # the manifest travels as JSON in the HTTP answer
    got_hs, got_tok = MooncakeHiddenStates(store).get(json.loads(json.dumps(manifest)), timeout=1)
    assert np.array_equal(got_hs.view(np.int16), hs.view(torch.int16).numpy())
    assert np.array_equal(got_tok, tok.numpy())
    # and our producer lays the same tensors out exactly as theirs
    assert packed_manifest("theirs", got_hs, got_tok) == json.loads(json.dumps(manifest))
    ref.delete_sample("theirs")
    assert store.objects == {}
