"""One of two processes loading a verifier over a 2x2 (fsdp, tensor) mesh of 4 CPU devices
(2 per process; tests.multiprocess.launch):

    python -m tests.verifier.load_child FOLDER --coordinator-address HOST:PORT
        --num-processes 2 --process-id I

Prints ``ok <reads>`` when every addressable shard equals the file's slice
(stacked layers: each layer's tensor's slice) and the process read exactly its own shards'
slices (nothing else)."""

from __future__ import annotations

import argparse

import jax
import numpy as np

from dspark_jax import parallel
from dspark_jax.verifier import load_verifier_config, weights


def main(folder: str, coordinator_address: str, num_processes: int, process_id: int) -> None:
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    cfg = load_verifier_config(folder)
    mesh = parallel.make_mesh("fsdp=2,tensor=2")
    reads: dict[str, list] = {}
    real = weights.readers

    def recording(ckpt, c):
        table = real(ckpt, c)

        def wrap(name, read):
            def r(index):
                reads.setdefault(name, []).append(index)
                return read(index)

            return r

        return {n: (spec, wrap(n, read)) for n, (spec, read) in table.items()}

    weights.readers = recording
    params = weights.load_params(folder, cfg, mesh, np.float32)
    from safetensors.numpy import load_file

    tensors = {
        k.removeprefix("model."): v for k, v in load_file(f"{folder}/model.safetensors").items()
    }

    def hf(name):
        """HF's tensor of a per-layer name; Hub per-expert tensors stacked as fused."""
        if name in tensors:
            return tensors[name]
        base, fused = name.rsplit("experts.", 1)
        parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
        count = sum(k.startswith(f"{base}experts.") and k.endswith(".down_proj.weight")
                    for k in tensors)  # fmt: skip
        return np.stack([
            np.concatenate([tensors[f"{base}experts.{e}.{p}.weight"] for p in parts])
            for e in range(count)
        ])  # fmt: skip

    specs = weights.param_specs(cfg)  # stacked layers: HF's tensors of those layers, stacked
    full = {
        n: np.stack([hf(weights.layer_key(n, i)) for i in s.layers]) if s.layers else hf(n)
        for n, s in specs.items()
    }
    sharded = 0
    for name, arr in params.items():
        own = {tuple((s.start, s.stop) for s in sh.index) for sh in arr.addressable_shards}
        got = {
            tuple(s.indices(d)[:2] for s, d in zip(ix, arr.shape, strict=True))
            for ix in reads[name]
        }
        norm = {
            tuple((a or 0, d if b is None else b) for (a, b), d in zip(t, arr.shape, strict=True))
            for t in own
        }
        assert got == norm, (name, got, norm)
        for sh in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(sh.data), full[name][sh.index])
        sharded += len(norm) < 2 or any(
            (b - a) < d for (a, b), d in zip(next(iter(norm)), arr.shape, strict=True)
        )
    print(f"ok {sum(len(v) for v in reads.values())} reads, {sharded} params", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--coordinator-address", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    main(**vars(parser.parse_args()))
