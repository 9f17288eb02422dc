"""Issue 4, test 2: our files are read by speculators 0.9.0's ArrowDataset (marked
``reference``) and by dspark_jax.data's readers to the same arrays."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dspark_jax.data import files, hs_names
from launch.extract_hidden_states import main

from .conftest import DEMO_TARGET_LAYERS


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, small_prepared, verifier_path):
    out = tmp_path_factory.mktemp("hs") / "hidden_states"
    assert (
        main(
            [
                "--backend",
                "hf",
                "--model",
                verifier_path,
                "--preprocessed-data",
                str(small_prepared),
                "--output",
                str(out),
                "--target-layer-ids",
                *map(str, DEMO_TARGET_LAYERS),
                "--device",
                "cpu",
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    return out


@pytest.mark.reference
def test_speculators_arrowdataset_reads_our_files(small_prepared, extracted, extractor):
    from datasets import load_from_disk
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import (
        check_hidden_states,
        find_corrupt_hidden_state_indices,
        get_existing_hidden_state_indices,
    )
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.recovery import SampleUnavailable

    rows = load_from_disk(str(small_prepared)).with_format(None)
    n = len(rows)
    assert get_existing_hidden_state_indices(extracted) == list(range(n))
    assert find_corrupt_hidden_state_indices(extracted, list(range(n))) == {}

    ds = ArrowDataset(
        max_len=2048,
        datapath=str(small_prepared),
        transfer=FileTransfer(extracted),
        on_missing="raise",
    )
    assert len(ds) == n
    n_aux, H = len(DEMO_TARGET_LAYERS), extractor.hidden_size
    items = []
    for i in range(n):
        item = ds[i]
        assert not isinstance(item, SampleUnavailable), i
        f = load_file(extracted / f"hs_{i}.safetensors")
        check_hidden_states(f, rows[i]["input_ids"])
        T = len(rows[i]["input_ids"])
        assert item["hidden_states"].shape == (T, n_aux * H)
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], f["hidden_states"][:, :-1].reshape(T, -1))
        assert torch.equal(item["verifier_last_hidden_states"], f["hidden_states"][:, -1])
        assert item["input_ids"].tolist() == rows[i]["input_ids"]
        assert item["loss_mask"].tolist() == rows[i]["loss_mask"]
        # layer-major flattening: aux slot j occupies columns [j*H, (j+1)*H)
        for j in range(n_aux):
            assert torch.equal(
                item["hidden_states"][:, j * H : (j + 1) * H], f["hidden_states"][:, j]
            )
        items.append(item)

    batch = CollateFn(max_len=1024, hidden_size=H, num_target_layers=n_aux)(items[:3])
    assert batch["hidden_states"].shape == (1, 1024, n_aux * H)
    assert batch["verifier_last_hidden_states"].shape == (1, 1024, H)
    assert batch["error_records"] == 0


def test_dspark_jax_readers_agree(small_prepared, extracted, extractor):
    """Same arrays through the JAX side's torch-free readers (dspark_jax.data.files)."""
    import ml_dtypes
    import numpy as np
    from datasets import load_from_disk

    rows = load_from_disk(str(small_prepared)).with_format(None)
    prep = files.PreparedDataset(small_prepared)
    assert len(prep) == len(rows)
    for i in range(len(prep)):
        ids = prep.input_ids(i)
        assert ids.tolist() == rows[i]["input_ids"]
        assert prep.loss_mask(i).tolist() == rows[i]["loss_mask"]
        assert int(prep.seq_len[i]) == rows[i]["seq_len"]
        hs = files.read_hidden_states(
            hs_names.hs_path(extracted, i),
            row=i,
            input_ids=ids,
            n_aux=len(DEMO_TARGET_LAYERS),
            hidden_size=extractor.hidden_size,
            dtype=np.dtype(ml_dtypes.bfloat16),
        )
        ours = load_file(extracted / f"hs_{i}.safetensors")["hidden_states"]
        assert hs.values.shape == tuple(ours.shape)
        # bit-identical bf16
        assert np.array_equal(
            hs.values.view(np.uint16), ours.view(torch.int16).numpy().view(np.uint16)
        )
