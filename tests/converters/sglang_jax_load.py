"""Run inside an sglang-jax environment (not this project's): load a drafter folder with
sglang-jax's own ``DSparkDraftModel`` (``sgl_jax.srt.models.dspark``: its config read by
``ModelConfig``/``AutoConfig``, its weights by ``WeightLoader``) on the JAX CPU backend
and run the forward pieces that need no attention backend: the context projection
(``project_target_hidden``), each layer's context K/V (``materialize_kv``: k_proj,
k_norm, RoPE) and the Markov head's greedy chain (``sample_block_tokens``).

    python sglang_jax_load.py FOLDER INPUTS.npz OUTPUTS.npz

INPUTS: ``target_hidden`` [T, K*Ht], ``positions`` [T], ``base_logits`` [B, P, V],
``first`` [B]. OUTPUTS: ``proj`` [T, H], ``k{i}``/``v{i}`` [T, KV, hd] per layer,
``tokens`` [B, P]. A load failure prints ``LOAD_ERROR: <type>: <message>`` and exits 3.
Used by tests/converters/test_sglang_jax_load.py.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.mesh import AxisType
from jax.sharding import Mesh


def main(folder: str, inputs: str, outputs: str) -> int:
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.models.dspark import DSparkDraftModel

    mesh = Mesh(
        np.array(jax.devices()[:1]).reshape(1, 1),
        ("data", "tensor"),
        axis_types=(AxisType.Explicit, AxisType.Explicit),
    )
    inp = np.load(inputs)
    try:
        model_config = ModelConfig(folder, is_draft_model=True, dtype="float32")
        with jax.set_mesh(mesh):
            model = DSparkDraftModel(model_config.hf_config, mesh=mesh, dtype=jnp.float32)
            model.load_weights(model_config)
    except Exception as e:  # the engine's own error, reported to the test
        print(f"LOAD_ERROR: {type(e).__name__}: {e}".replace("\n", " "))
        return 3
    with jax.set_mesh(mesh):
        th = jnp.asarray(inp["target_hidden"])
        out = {"proj": model.project_target_hidden(th)}
        for i, (k, v) in enumerate(model.materialize_kv(th, jnp.asarray(inp["positions"]))):
            out[f"k{i}"], out[f"v{i}"] = k, v
        out["tokens"] = model.sample_block_tokens(
            jnp.asarray(inp["base_logits"]), jnp.asarray(inp["first"])
        )
    np.savez(outputs, **{k: np.asarray(v) for k, v in out.items()})
    print("LOADED")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
