"""Parity of the data path with speculators 0.9.0 (ArrowDataset, sampler, CollateFn,
vocab mapping, verifier weight loading), on files written by the reference's own
writers (datasets.save_to_disk, safetensors.torch, hs_connectors' fp8 quantiser)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

from safetensors.torch import save_file

from dspark_jax.data.files import PreparedDataset
from dspark_jax.data.packing import plan_epoch
from dspark_jax.data.pipeline import PackedData
from dspark_jax.data.vocab import build_vocab_maps, load_token_freq
from dspark_jax.verifier.frozen import load_verifier_tensors

pytestmark = pytest.mark.reference

S, H, N_AUX, N_DOCS = 64, 8, 2, 40
KEYS = (
    "hidden_states",
    "verifier_last_hidden_states",
    "input_ids",
    "loss_mask",
    "position_ids",
    "document_ids",
)


def write_reference_data(root, *, fp8: bool):
    """Prepared dataset via datasets.save_to_disk; hs files as the vLLM connectors write."""
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    g = torch.Generator().manual_seed(0)
    # Distinct lengths (one longer than S): tie order is where plans may differ.
    lengths = (torch.randperm(N_DOCS, generator=g) + 1).tolist()
    lengths[3] = S + 20
    ids = [torch.randint(0, 1000, (n,), generator=g) for n in lengths]
    masks = [(torch.rand(n, generator=g) < 0.6).long() for n in lengths]
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [x.tolist() for x in ids],
            "loss_mask": [m.tolist() for m in masks],
            "seq_len": lengths,
        }
    )
    ds.set_format(type="torch")
    data_path = root / "prepared"
    ds.save_to_disk(str(data_path), num_shards=3)
    hs_dir = data_path / "hidden_states"
    hs_dir.mkdir()
    for i, x in enumerate(ids):
        h = torch.randn(len(x), N_AUX + 1, H, generator=g) * (1 + i % 3)
        if fp8:
            q, scale = quantize_tensor_to_fp8(h.bfloat16())
            tensors = {"hidden_states": q, SCALES_KEY: scale}
        else:
            tensors = {"hidden_states": h.bfloat16()}
        tensors["token_ids"] = x.long()
        save_file(tensors, str(hs_dir / f"hs_{i}.safetensors"))
    return data_path, hs_dir


def reference_batches(data_path, hs_dir, *, split, ratio, seed, epoch, replicas, fp8):
    """Per step, per rank: the reference's collated row (torch tensors)."""
    from hs_connectors import FileTransfer
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    transfer = FP8Transfer(hs_dir) if fp8 else FileTransfer(hs_dir)
    ds = ArrowDataset(
        max_len=S,
        datapath=str(data_path),
        transfer=transfer,
        on_missing="raise",
        train_ratio=ratio,
        split=split,
        hidden_states_dtype=torch.bfloat16,
    )
    collate = CollateFn(S, H, num_target_layers=N_AUX, dtype=torch.bfloat16)
    per_rank = []
    for rank in range(replicas):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sampler = MultipackDistributedBatchSamplerV2(
                S, ds.approx_lengths, replicas, rank, seed=seed
            )
        sampler.set_epoch(epoch)
        per_rank.append([collate([ds[int(i)] for i in idx]) for idx in sampler])
    return [[per_rank[r][t] for r in range(replicas)] for t in range(len(per_rank[0]))]


def as_numpy(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def ours_as_comparable(v):
    return v.view(np.int16) if v.dtype.name == "bfloat16" else v


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_packed_batches_equal_reference_arrowdataset(tmp_path, fp8):
    data_path, hs_dir = write_reference_data(tmp_path, fp8=fp8)
    ratio, seed, replicas = 0.8, 11, 2
    data = PackedData(
        data_path,
        total_seq_len=S,
        n_aux=N_AUX,
        hidden_size=H,
        train_data_ratio=ratio,
        rows_per_process=replicas,
        process_index=0,
        process_count=1,
        seed=seed,
        hidden_states_dtype="bfloat16",
    )
    for split, epochs in (("train", (0, 1)), ("val", (0,))):
        for epoch in epochs:
            ref = reference_batches(
                data_path,
                hs_dir,
                split=split,
                ratio=ratio,
                seed=seed if split == "train" else 0,
                epoch=epoch,
                replicas=replicas,
                fp8=fp8,
            )
            it = (
                data.train_iterator(num_epochs=epoch + 1)
                if split == "train"
                else data.val_iterator(epoch=epoch)
            )
            if split == "train":
                it.set_state({"epoch": epoch, "step": 0})
            ours = list(it)
            assert len(ours) == len(ref) > 0, (split, epoch)
            for t, (mine, theirs) in enumerate(zip(ours, ref)):
                for r in range(replicas):
                    for k in KEYS:
                        np.testing.assert_array_equal(
                            ours_as_comparable(mine[k][r]),
                            as_numpy(theirs[r][k][0]),
                            err_msg=f"{split} epoch {epoch} step {t} rank {r} {k}",
                        )


def test_reader_reads_datasets_save_to_disk(tmp_path):
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]],
            "loss_mask": [[0, 1, 1], [1], [0, 1], [1, 1, 0, 1]],
            "seq_len": [3, 1, 2, 4],
        }
    )
    ds = ds.select([3, 1, 0, 2])  # an indices mapping, flattened by save_to_disk
    ds.save_to_disk(str(tmp_path / "d"), num_shards=2)
    ours = PreparedDataset(tmp_path / "d")
    theirs = datasets.load_from_disk(str(tmp_path / "d"))
    assert len(ours) == len(theirs)
    for i in range(len(theirs)):
        assert ours.input_ids(i).tolist() == theirs[i]["input_ids"]
        assert ours.loss_mask(i).tolist() == theirs[i]["loss_mask"]
        assert int(ours.seq_len[i]) == theirs[i]["seq_len"]


def test_plan_equals_reference_sampler_without_length_ties():
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    rng = np.random.default_rng(0)
    for trial in range(12):
        S_ = int(rng.integers(16, 200))
        replicas = int(rng.integers(1, 7))
        lengths = rng.permutation(np.arange(1, S_))[: int(rng.integers(1, S_ - 1))]
        for epoch in (0, 3):
            plan = plan_epoch(lengths, S_, replicas, seed=trial, epoch=epoch)
            for rank in range(replicas):
                s = MultipackDistributedBatchSamplerV2(S_, lengths, replicas, rank, seed=trial)
                ref = s._generate_batches(epoch)
                assert len(ref) == plan.num_steps
                for t, idx in enumerate(ref):
                    np.testing.assert_array_equal(plan.row(t, rank), idx)


def test_token_freq_and_vocab_maps_equal_reference(tmp_path):
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [torch.randint(0, 50, (n,), generator=g).tolist() for n in (30, 17, 44)],
            "loss_mask": [(torch.rand(n, generator=g) < 0.7).long().tolist() for n in (30, 17, 44)],
        }
    )
    ds.set_format(type="torch")
    save_token_frequency_distribution(ds, tmp_path / "token_freq.pt")
    freq = load_token_freq(tmp_path / "token_freq.pt")
    assert freq == torch.load(tmp_path / "token_freq.pt", weights_only=True)
    for vd in (5, 20, len(freq), len(freq) + 7):
        d2t, t2d = build_vocab_maps(freq, vd, 64)
        rd2t, rt2d = build_vocab_mappings_from_distribution(freq, vd, 64)
        np.testing.assert_array_equal(d2t, rd2t.numpy())
        np.testing.assert_array_equal(t2d, rt2d.numpy())


@pytest.mark.parametrize("sharded", [False, True])
def test_verifier_tensors_equal_load_model_layers(tmp_path, sharded):
    from speculators.utils.loading import load_model_layers

    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(32, 8, generator=g).bfloat16(),
        "model.norm.weight": torch.randn(8, generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).bfloat16(),
    }
    folder = tmp_path / "verifier"
    folder.mkdir()
    if sharded:
        names = list(tensors)
        wmap = {}
        for s in range(2):
            fname = f"model-{s + 1:05d}-of-00002.safetensors"
            save_file({k: tensors[k] for k in names[s::2]}, str(folder / fname))
            wmap.update({k: fname for k in names[s::2]})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    names = ["embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    ref = load_model_layers(names, str(folder))
    ours = load_verifier_tensors(folder)
    for name, got in zip(names, (ours.embed_tokens, ours.lm_head, ours.norm)):
        np.testing.assert_array_equal(got.view(np.int16), ref[name].view(torch.int16).numpy())
