"""dspark_jax.convert.importer: speculators DSpark/DFlash folder -> Orbax params checkpoint."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from converters.__main__ import main
from dspark_jax.checkpoint import orbax_io
from dspark_jax.convert.export import export_checkpoint, export_params
from dspark_jax.convert.importer import ImportFolderError, WarmStart, import_folder
from tests.converters.helpers import (
    base_config,
    flat_params,
    make_vocab,
    random_params,
    tree_digest,
    write_verifier,
)


def bf16_round(params):
    """The params as a bf16 export holds them (the confidence head is exported fp32)."""
    bf16 = {
        k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in flat_params(params).items()
    }
    return {
        k: v if k.startswith("confidence_head/") else bf16[k]
        for k, v in flat_params(params).items()
    }


def tensors_of(folder):
    with safe_open(folder / "model.safetensors", "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def rewrite(folder, config_fn=None, tensor_fn=None):
    if config_fn:
        d = json.loads((folder / "config.json").read_text())
        config_fn(d)
        (folder / "config.json").write_text(json.dumps(d))
    if tensor_fn:
        t = tensors_of(folder)
        tensor_fn(t)
        save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    root = tmp_path_factory.mktemp("imp")
    cfg = base_config(draft_vocab_size=40, verifier_name_or_path="org/v")
    verifier = write_verifier(root / "verifier", cfg)
    params = random_params(cfg, seed=7)
    maps = make_vocab(cfg, seed=7)
    export_params(cfg, params, root / "src", vocab_maps=maps, verifier_path=verifier)
    return root, cfg, params, maps, verifier


def test_dspark_import_then_export_is_bit_exact(reduced, tmp_path):
    root, cfg, params, maps, verifier = reduced
    result = import_folder(root / "src", tmp_path / "ck", step=3, verifier_path=verifier)
    assert result.kind == "dspark" and result.cfg == cfg
    assert result.step_dir == (tmp_path / "ck" / "3").absolute()
    assert [p.name for p in result.vocab_maps] == ["d2t-40.npy", "t2d-40.npy"]
    np.testing.assert_array_equal(np.load(result.vocab_maps[0]), maps[0])
    np.testing.assert_array_equal(np.load(result.vocab_maps[1]), maps[1])
    loaded = orbax_io.load_params(tmp_path / "ck")
    assert loaded.meta["source_type"] == "dspark"
    assert loaded.meta["vocab_maps"] == {"d2t": "d2t-40.npy", "t2d": "t2d-40.npy"}
    got, want = flat_params(loaded.params), bf16_round(params)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    export_checkpoint(tmp_path / "ck", tmp_path / "again", verifier_path=verifier)
    a, b = tensors_of(root / "src"), tensors_of(tmp_path / "again")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    assert (root / "src" / "config.json").read_text() == (
        tmp_path / "again" / "config.json"
    ).read_text()


def test_vllm_only_folder_without_t2d(reduced, tmp_path):
    root, _, _, maps, _ = reduced
    shutil.copytree(root / "src", tmp_path / "src")
    rewrite(tmp_path / "src", tensor_fn=lambda t: t.pop("t2d"))
    result = import_folder(tmp_path / "src", tmp_path / "ck")
    np.testing.assert_array_equal(np.load(result.vocab_maps[1]), maps[1])


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t: t.update(extra=np.zeros(2, np.float32)), r"unexpected tensors \['extra'\]"),
        (
            lambda t: t.pop("layers.0.mlp.down_proj.weight"),
            r"missing tensor 'layers\.0\.mlp\.down_proj\.weight'",
        ),
        (
            lambda t: t.update({"fc.weight": np.zeros((32, 65), np.float32)}),
            r"tensor 'fc\.weight': expected shape \(32, 64\) \(torch layout\), got \(32, 65\)",
        ),
        (lambda t: t.pop("d2t"), r"no 'd2t' tensor"),
        (lambda t: t.update(t2d=np.roll(t["t2d"], 1)), r"d2t and t2d disagree"),
        (
            lambda t: t.update({"lm_head.weight": t["lm_head.weight"] * 2}),
            r"'lm_head\.weight' differs from the rows t2d of the verifier head",
        ),
    ],
)
def test_bad_folders_name_the_tensor(reduced, tmp_path, edit, pattern):
    root, _, _, _, verifier = reduced
    shutil.copytree(root / "src", tmp_path / "src")
    rewrite(tmp_path / "src", tensor_fn=edit)
    with pytest.raises(ImportFolderError, match=pattern):
        import_folder(tmp_path / "src", tmp_path / "ck", verifier_path=verifier)
    assert not (tmp_path / "ck" / "0").exists()


def test_dspark_config_without_sample_from_anchor_is_refused(reduced, tmp_path):
    root, *_ = reduced
    shutil.copytree(root / "src", tmp_path / "src")
    rewrite(tmp_path / "src", config_fn=lambda d: d.pop("sample_from_anchor"))
    with pytest.raises(ImportFolderError, match="no 'sample_from_anchor': ambiguous"):
        import_folder(tmp_path / "src", tmp_path / "ck")


def test_norm_style_of_a_speculators_folder_comes_from_the_verifier(reduced, tmp_path):
    """speculators writes no verifier_norm_style: it decides from the verifier's model_type
    when it loads the folder, and so does the import (a recorded one is kept)."""
    root, *_ = reduced
    shutil.copytree(root / "src", tmp_path / "src")
    shutil.copytree(root / "verifier", tmp_path / "gemma")
    rewrite(tmp_path / "gemma", config_fn=lambda d: d.update(model_type="gemma3_text"))
    rewrite(tmp_path / "src", config_fn=lambda d: d.pop("verifier_norm_style"))
    result = import_folder(tmp_path / "src", tmp_path / "ck", verifier_path=tmp_path / "gemma")
    assert result.cfg.verifier_norm_style == "gemma"
    result = import_folder(tmp_path / "src", tmp_path / "ck2")  # org/v: not a local folder
    assert result.cfg.verifier_norm_style == "plain"
    rewrite(tmp_path / "src", config_fn=lambda d: d.update(verifier_norm_style="plain"))
    result = import_folder(tmp_path / "src", tmp_path / "ck3", verifier_path=tmp_path / "gemma")
    assert result.cfg.verifier_norm_style == "plain"


def make_dflash(src, dst):
    """A speculators DFlash folder from a DSpark export: same backbone, no heads."""
    shutil.copytree(src, dst)

    def config(d):
        for k in (
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
        ):
            d.pop(k)
        d.update(
            speculators_model_type="dflash",
            architectures=["DFlashDraftModel"],
            sample_from_anchor=False,
        )
        d["speculators_config"]["algorithm"] = "dflash"
        d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = d["block_size"] - 1

    def tensors(t):
        for k in [k for k in t if k.startswith(("markov_head.", "confidence_head."))]:
            t.pop(k)

    rewrite(dst, config, tensors)


def test_dflash_warm_start(reduced, tmp_path):
    root, cfg, params, _, _ = reduced
    make_dflash(root / "src", tmp_path / "dflash")
    ws = WarmStart(markov_rank=16, seed=3)
    result = import_folder(tmp_path / "dflash", tmp_path / "ck", warm_start=ws)
    assert result.kind == "dflash"
    assert result.cfg == cfg.replace(markov_rank=16, sample_from_anchor=False)
    got, want = flat_params(result.params), bf16_round(params)
    heads = ("markov_head/", "confidence_head/")
    for k in want:
        if not k.startswith(heads):
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert got["markov_head/markov_w1/embedding"].shape == (64, 16)
    assert got["markov_head/markov_w2/kernel"].shape == (16, 40)
    assert got["confidence_head/proj/kernel"].shape == (32 + 16, 1)
    # N(0, 0.01) over 64 x 16 draws: the sample sd has standard error 0.01 / sqrt(2 * 1024)
    # = 2.2e-4; seeded, within 4 of them.
    w1 = got["markov_head/markov_w1/embedding"]
    assert abs(w1.std() - 0.01) < 4 * 0.01 / np.sqrt(2 * w1.size)
    # U(+-1/sqrt(r)), r = 16: every draw within 1/4, and the largest of 640 draws within 4%
    # of it (P(all 640 below 0.24) = 0.96^640 < 1e-11), so a smaller scale fails too.
    w2 = np.abs(got["markov_head/markov_w2/kernel"])
    assert w2.max() <= 1 / 4 and w2.max() > 0.96 / 4
    meta = orbax_io.load_params(tmp_path / "ck").meta
    assert meta["source_type"] == "dflash" and meta["warm_start"]["markov_rank"] == 16
    # Seeded: the same seed gives the same heads, another seed other heads.
    again = import_folder(tmp_path / "dflash", tmp_path / "ck2", warm_start=ws)
    other = import_folder(
        tmp_path / "dflash",
        tmp_path / "ck3",
        warm_start=WarmStart(markov_rank=16, seed=4, sample_from_anchor=True),
    )
    np.testing.assert_array_equal(
        flat_params(again.params)["markov_head/markov_w1/embedding"],
        got["markov_head/markov_w1/embedding"],
    )
    assert not np.array_equal(
        flat_params(other.params)["markov_head/markov_w1/embedding"],
        got["markov_head/markov_w1/embedding"],
    )
    assert other.cfg.sample_from_anchor is True
    with pytest.raises(ImportFolderError, match="warm-start options apply to DFlash folders only"):
        import_folder(root / "src", tmp_path / "ck4", warm_start=ws)


def test_cli_import(reduced, tmp_path, capsys):
    root, *_ = reduced
    make_dflash(root / "src", tmp_path / "dflash")
    assert (
        main(
            [
                "import",
                str(tmp_path / "dflash"),
                str(tmp_path / "ck"),
                "--markov-rank",
                "16",
                "--no-confidence-head",
                "--step",
                "9",
            ]
        )
        == 0
    )
    assert "imported dflash folder" in capsys.readouterr().out
    loaded = orbax_io.load_params(tmp_path / "ck")
    assert loaded.step == 9 and loaded.cfg.markov_rank == 16
    assert not loaded.cfg.enable_confidence_head
    assert main(["import", str(tmp_path / "dflash"), str(tmp_path / "ck"), "--step", "9"]) == 1
    assert "ck is not empty (9, d2t-40.npy, t2d-40.npy)" in capsys.readouterr().err
    # --overwrite replaces a step of an earlier import.
    argv = ["import", str(tmp_path / "dflash"), str(tmp_path / "ck"), "--step", "9"]
    assert main([*argv, "--markov-rank", "8", "--overwrite"]) == 0
    assert orbax_io.load_params(tmp_path / "ck").cfg.markov_rank == 8
    assert main(["import", str(root / "src"), str(tmp_path / "ck5")]) == 0


def fake_run_dir(path, cfg):
    """What a training --save-path holds: a step (no source_type), maps, run.yaml."""
    orbax_io.save_params_checkpoint(path, 5, cfg, random_params(cfg, seed=1), meta={"epoch": 0})
    orbax_io.save_checkpoint_vocab_maps(path, cfg, *make_vocab(cfg, seed=1))
    (path / "run.yaml").write_text("train: {}\n")
    return path


def test_import_never_writes_into_a_training_run(reduced, tmp_path, capsys):
    """Issue 18.1: the run's step and vocab maps stay byte-identical; --overwrite too."""
    root, cfg, *_ = reduced
    run = fake_run_dir(tmp_path / "run", cfg)
    before = tree_digest(run)
    assert main(["import", str(root / "src"), str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"import failed: {run} is not empty (5, d2t-40.npy, run.yaml, t2d-40.npy); import "
        "into a new or empty directory (--overwrite replaces a step of an earlier import only)"
    ]
    assert main(["import", str(root / "src"), str(run), "--step", "5", "--overwrite"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"import failed: {run} holds a training run (steps ['5']), not an earlier import; "
        "--overwrite replaces imported steps only"
    ]
    assert tree_digest(run) == before


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(mask_token_id=3.5), "mask_token_id must be an int or null, got 3.5"),
        (lambda d: d.update(markov_rank="256"), "markov_rank must be an int, got '256'"),
        (
            lambda d: d.update(sample_from_anchor="false"),
            "sample_from_anchor must be true or false, got 'false'",
        ),
        (
            lambda d: d["transformer_layer_config"].update(hidden_size=32.0),
            "transformer_layer_config.hidden_size must be an int, got 32.0",
        ),
        (
            lambda d: d.update(aux_hidden_state_layer_ids=[1, "2"]),
            "aux_hidden_state_layer_ids must be a list of ints, got [1, '2']",
        ),
    ],
)
def test_config_types_are_checked_on_import(reduced, tmp_path, capsys, edit, message):
    """Issue 18.6: int() would read 3.5 as 3 and "false" as True; nothing is written."""
    root, *_ = reduced
    shutil.copytree(root / "src", tmp_path / "src")
    rewrite(tmp_path / "src", config_fn=edit)
    assert main(["import", str(tmp_path / "src"), str(tmp_path / "ck")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"src/config.json: {message}"), err
    assert not (tmp_path / "ck").exists()


def test_truncated_safetensors_is_named(reduced, tmp_path, capsys):
    """Issue 18.10: import and check name the unreadable file, on one line."""
    root, *_ = reduced
    shutil.copytree(root / "src", tmp_path / "src")
    weights = tmp_path / "src" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["import", str(tmp_path / "src"), str(tmp_path / "ck")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"import failed: {weights}: not a readable safetensors file (Error while deserializing "
        "header: incomplete metadata, file not fully covered)"
    ]
    assert main(["check", str(tmp_path / "src")]) == 1
    assert f"{weights}: not a readable safetensors file" in capsys.readouterr().out
    assert not (tmp_path / "ck").exists()


def test_load_drafter_reads_a_folder_as_its_import_does(reduced, tmp_path):
    """The one-pass loader gives what importing the folder and loading the checkpoint give:
    the same config, bit-identical params, the same vocab maps; explicit maps win."""
    from dspark_jax.checkpoint.load import DrafterLoadError, load_drafter

    root, cfg, params, maps, verifier = reduced
    make_dflash(root / "src", tmp_path / "dflash")
    for src in (root / "src", tmp_path / "dflash"):
        ck = tmp_path / f"ck-{src.name}"
        import_folder(src, ck, verifier_path=verifier)
        want = orbax_io.load_params(ck, 0)
        want_maps = orbax_io.load_checkpoint_vocab_maps(ck, want.cfg)
        got = load_drafter(src, verifier_path=verifier)
        assert got.cfg == want.cfg and got.step is None
        assert got.source == f"speculators folder {src}"
        a, b = flat_params(got.params), flat_params(want.params)
        assert set(a) == set(b)
        for k in b:
            assert a[k].dtype == b[k].dtype == np.float32, k
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        for g, w in zip(got.vocab_maps, want_maps, strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)

    other = make_vocab(cfg, seed=8)
    for name, array in zip(("d2t", "t2d"), other, strict=True):
        np.save(tmp_path / f"{name}.npy", array)
    got = load_drafter(root / "src", d2t_path=tmp_path / "d2t.npy", t2d_path=tmp_path / "t2d.npy")
    np.testing.assert_array_equal(got.vocab_maps[0], other[0])
    np.testing.assert_array_equal(got.vocab_maps[1], other[1])
    with pytest.raises(DrafterLoadError, match="give both d2t and t2d paths"):
        load_drafter(root / "src", d2t_path=tmp_path / "d2t.npy")
