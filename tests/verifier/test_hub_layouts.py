"""The verifier folders of the Hub, beyond transformers' own save (issue 41).

* Qwen3-MoE with one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``,
  ``down_proj``: Qwen3-30B-A3B's layout), built from transformers' fused save
  (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]): the same
  parameters bit for bit, so the same hidden states; on a mesh whose fsdp axis splits the
  experts, every device's shard reads only its own experts, and of them only its rows and
  columns, each byte once.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax import parallel
from dspark_jax.verifier import hidden_states, load_verifier_config, weights
from tests.verifier.test_forward import LAYER_IDS, packed_row


def _per_expert(fused_folder, out):
    """The fused checkpoint rewritten in the Hub's per-expert naming."""
    out.mkdir()
    shutil.copy(fused_folder / "config.json", out / "config.json")
    tensors = {}
    for key, value in load_file(str(fused_folder / "model.safetensors")).items():
        if key.endswith("experts.gate_up_proj"):
            base, inter = key.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{base}{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :inter])
                tensors[f"{base}{e}.up_proj.weight"] = np.ascontiguousarray(value[e, inter:])
        elif key.endswith("experts.down_proj"):
            base = key.removesuffix("down_proj")
            for e in range(value.shape[0]):
                tensors[f"{base}{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
        else:
            tensors[key] = value
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    from tests.verifier.hf_models import build

    root = tmp_path_factory.mktemp("hub")
    build("qwen3_moe", root / "fused")
    tensors = _per_expert(root / "fused", root / "per_expert")
    assert not any(k.endswith("gate_up_proj") for k in tensors)
    assert any(".experts.3.up_proj.weight" in k for k in tensors)
    return root / "fused", root / "per_expert"


def test_per_expert_tensors_give_the_fused_parameters_and_states(moe_folders):
    fused, per_expert = moe_folders
    cfg = load_verifier_config(per_expert)
    assert cfg.num_experts == 4
    a = weights.load_params(fused, cfg, dtype=jnp.float32)
    b = weights.load_params(per_expert, cfg, dtype=jnp.float32)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
    _, ids, pos, doc = packed_row()
    run = jax.jit(lambda p: hidden_states(p, cfg, ids, pos, doc, LAYER_IDS, q_block=8, kv_chunk=8))
    np.testing.assert_array_equal(np.asarray(run(a)), np.asarray(run(b)))


class _Recorded:
    """A memory-mapped tensor whose slicing is recorded (key, rows, columns)."""

    def __init__(self, key, array, log):
        self.key, self.array, self.log = key, array, log

    def __getitem__(self, index):
        if ".experts." in self.key:
            rows, cols = index
            n, m = self.array.shape
            self.log.append((self.key, rows.indices(n)[:2], cols.indices(m)[:2]))
        return self.array[index]


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 8 (simulated) devices")
def test_each_shard_reads_only_its_experts(moe_folders, monkeypatch):
    """fsdp=2 x tensor=2: E=4 experts over fsdp (2 per device), the rows (2I of gate_up,
    I of down) over tensor. Each shard's callback views only its experts' tensors and
    slices only its rows and columns of them."""
    _, per_expert = moe_folders
    cfg = load_verifier_config(per_expert)
    mesh = parallel.make_mesh("fsdp=2,tensor=2", jax.devices()[:4])
    sh = weights.param_shardings(cfg, mesh)
    name = next(n for n in sh if n.endswith("experts.gate_up_proj"))
    assert sh[name].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    log, current = [], {}
    real_view = weights.Checkpoint.view
    monkeypatch.setattr(
        weights.Checkpoint,
        "view",
        lambda self, n: _Recorded(n, real_view(self, n), current.setdefault("reads", [])),
    )
    real_readers = weights.readers

    def recording(ckpt, c):
        def wrap(n, read):
            def r(index):
                current["reads"] = []
                out = read(index)
                log.append((n, index, current.pop("reads")))
                return out

            return r

        return {n: (spec, wrap(n, read)) for n, (spec, read) in real_readers(ckpt, c).items()}

    monkeypatch.setattr(weights, "readers", recording)
    params = weights.load_params(per_expert, cfg, mesh, jnp.float32)
    hidden = cfg.hidden_size
    expert_reads = [(n, ix, reads) for n, ix, reads in log if ".experts." in n]
    moe_stacks = sum(kind.moe for kind, _ in cfg.layer_stacks)
    assert len(expert_reads) == 2 * 4 * moe_stacks  # 2 tensors x 4 shards
    bytes_read = {}
    for n, index, reads in expert_reads:
        es = index[1]  # index[0]: the stack's layers, every one
        experts = set(range(*es.indices(cfg.num_experts)))
        assert len(experts) == 2  # fsdp=2 splits the 4 experts
        touched = {int(key.split(".experts.")[1].split(".")[0]) for key, _, _ in reads}
        assert touched == experts, (n, index, touched)
        for key, (r0, r1), (c0, c1) in reads:
            # tensor splits the MLP width: gate/up rows (I), down columns (I); H is whole
            whole = (c0, c1) if n.endswith("gate_up_proj") else (r0, r1)
            assert whole == (0, hidden)
            bytes_read[key] = bytes_read.get(key, 0) + (r1 - r0) * (c1 - c0) * 4
    # Every expert tensor read once per layer that holds it: each byte exactly once.
    sizes = {
        k.removeprefix("model."): v.nbytes
        for k, v in load_file(str(per_expert / "model.safetensors")).items()
    }
    for key, n in bytes_read.items():
        assert n == sizes[key], (key, n, sizes[key])
    assert {k for k in sizes if ".experts." in k} == set(bytes_read)
    fused = weights.load_params(moe_folders[0], cfg, dtype=jnp.float32)
    for n, arr in params.items():
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(fused[n]), err_msg=n)
    assert json.loads((per_expert / "config.json").read_text())["model_type"] == "qwen3_moe"
