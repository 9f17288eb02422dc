"""Draft vocabulary maps: token_freq.pt without torch, building, loading, resolution."""

from __future__ import annotations

import io
import pickle
import zipfile

import numpy as np
import pytest

from dspark_jax.data.vocab import (
    VocabError,
    build_vocab_maps,
    check_vocab_maps,
    load_token_freq,
    load_vocab_maps,
    resolve_vocab_maps,
    save_vocab_maps,
)


def write_torch_style(path, obj, *, persistent=False):
    """The torch.save zip layout (archive/data.pkl, protocol 2, + version files)."""
    buf = io.BytesIO()

    class P(pickle.Pickler):
        def persistent_id(self, o):
            return ("storage", "x") if persistent and isinstance(o, float) else None

    P(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("token_freq/data.pkl", buf.getvalue())
        z.writestr("token_freq/byteorder", "little")
        z.writestr("token_freq/version", "3\n")


def test_token_freq_reads_without_torch(tmp_path):
    freq = {5: 3, 7: 10, 2**40: 1, 0: 2}
    write_torch_style(tmp_path / "token_freq.pt", freq)
    assert load_token_freq(tmp_path / "token_freq.pt") == freq


def test_token_freq_refuses_what_needs_torch(tmp_path):
    write_torch_style(tmp_path / "t.pt", {1: 2.5}, persistent=True)
    with pytest.raises(VocabError, match="stores tensors"):
        load_token_freq(tmp_path / "t.pt")
    write_torch_style(tmp_path / "c.pt", {1: np.int64(3)})
    with pytest.raises(VocabError, match="refusing to load numpy"):
        load_token_freq(tmp_path / "c.pt")
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({1: 2}))
    with pytest.raises(VocabError, match="not a torch zip archive"):
        load_token_freq(tmp_path / "legacy.pt")
    with pytest.raises(VocabError, match="no such file"):
        load_token_freq(tmp_path / "nope.pt")


def test_build_ranks_by_count_then_id_and_pads_with_smallest_unused():
    freq = {9: 5, 4: 5, 7: 9, 2: 1}
    d2t, t2d = build_vocab_maps(freq, 3, 12)
    np.testing.assert_array_equal(d2t + np.arange(3), [4, 7, 9])  # 7 (9), then 4, 9 tie (5)
    assert t2d.sum() == 3 and list(np.flatnonzero(t2d)) == [4, 7, 9]
    d2t, t2d = build_vocab_maps(freq, 6, 12)  # 4 counted + pad with 0, 1
    np.testing.assert_array_equal(d2t + np.arange(6), [0, 1, 2, 4, 7, 9])
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    with pytest.raises(VocabError, match="outside"):
        build_vocab_maps({20: 1}, 2, 12)


def test_checks_name_the_problem(tmp_path):
    d2t, t2d = build_vocab_maps({1: 3, 5: 2, 8: 1}, 3, 10)
    check_vocab_maps(d2t, t2d, draft_vocab_size=3, verifier_vocab_size=10)
    with pytest.raises(VocabError, match="d2t has size 3, but draft_vocab_size is 4"):
        check_vocab_maps(d2t, t2d, draft_vocab_size=4)
    with pytest.raises(VocabError, match="must match the verifier vocab size"):
        check_vocab_maps(d2t, t2d, verifier_vocab_size=11)
    t = t2d.copy()
    t[0] = True
    with pytest.raises(VocabError, match="t2d has 4 non-zero values, expected 3"):
        check_vocab_maps(d2t, t)
    t = t2d.copy()
    t[1], t[2] = False, True
    with pytest.raises(VocabError, match="disagree"):
        check_vocab_maps(d2t, t)
    save_vocab_maps(tmp_path, d2t, t2d)
    got = load_vocab_maps(tmp_path / "d2t-3.npy", tmp_path / "t2d-3.npy", verifier_vocab_size=10)
    np.testing.assert_array_equal(got[0], d2t)
    with pytest.raises(VocabError, match="not found"):
        load_vocab_maps(tmp_path / "d2t-9.npy", tmp_path / "t2d-9.npy")


def test_resolution_order(tmp_path):
    freq = {i: 100 - i for i in range(20)}
    d2t, t2d = build_vocab_maps(freq, 4, 32)
    assert resolve_vocab_maps(tmp_path, draft_vocab_size=None, verifier_vocab_size=32) is None
    assert resolve_vocab_maps(tmp_path, draft_vocab_size=32, verifier_vocab_size=32) is None
    with pytest.raises(VocabError, match="no token frequencies"):
        resolve_vocab_maps(tmp_path, draft_vocab_size=4, verifier_vocab_size=32)
    with pytest.raises(VocabError, match="together"):
        resolve_vocab_maps(
            tmp_path, draft_vocab_size=4, verifier_vocab_size=32, d2t_path=tmp_path / "x.npy"
        )
    # Built from token_freq.pt and cached with the size suffix.
    write_torch_style(tmp_path / "token_freq.pt", freq)
    got = resolve_vocab_maps(tmp_path, draft_vocab_size=4, verifier_vocab_size=32)
    np.testing.assert_array_equal(got[0], d2t)
    assert (tmp_path / "d2t-4.npy").exists() and (tmp_path / "t2d-4.npy").exists()
    # Cached files win over token_freq.pt; unsuffixed names are found too.
    (tmp_path / "token_freq.pt").unlink()
    np.testing.assert_array_equal(
        resolve_vocab_maps(tmp_path, draft_vocab_size=4, verifier_vocab_size=32)[1], t2d
    )
    other = build_vocab_maps({31: 5, 30: 4, 29: 3}, 3, 32)
    np.save(tmp_path / "d2t.npy", other[0])
    np.save(tmp_path / "t2d.npy", other[1])
    np.testing.assert_array_equal(
        resolve_vocab_maps(tmp_path, draft_vocab_size=3, verifier_vocab_size=32)[0], other[0]
    )
    # Explicit paths first; their size must match a given draft_vocab_size.
    got = resolve_vocab_maps(
        tmp_path,
        draft_vocab_size=None,
        verifier_vocab_size=32,
        d2t_path=tmp_path / "d2t-4.npy",
        t2d_path=tmp_path / "t2d-4.npy",
    )
    assert len(got[0]) == 4
    with pytest.raises(VocabError, match="d2t has size 4, but draft_vocab_size is 3"):
        resolve_vocab_maps(
            tmp_path,
            draft_vocab_size=3,
            verifier_vocab_size=32,
            d2t_path=tmp_path / "d2t-4.npy",
            t2d_path=tmp_path / "t2d-4.npy",
        )
