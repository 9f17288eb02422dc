"""``--hidden-states-backend jax``: the frozen verifier runs inside the step.

The data pipeline then packs token rows only (no ``hidden_states/``); each step first
computes the rows' hidden states with :mod:`dspark_jax.verifier` on the training mesh and
then the drafter's loss, in one compiled step. The verifier's weights are loaded once,
sharded by the trainer's logical-axis rules (each process reads only its devices' slices),
and never differentiated nor in the optimizer state (docs/design.md, "In-step verifier").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.config import DSparkConfig
from dspark_jax.verifier.config import VerifierConfig, load_verifier_config
from dspark_jax.verifier.forward import batch_hidden_states
from dspark_jax.verifier.weights import (
    Checkpoint,
    held_dtype,
    load_params,
    param_shardings,
    param_specs,
    readers,
)

BACKEND = "jax"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


class InStepError(ValueError):
    """The verifier folder does not fit the in-step backend or the drafter."""


@dataclasses.dataclass(frozen=True)
class InStepVerifier:
    folder: str
    cfg: VerifierConfig
    aux_layer_ids: tuple[int, ...]  # the drafter's, in its order
    param_dtype: Any
    out_dtype: Any  # what the file backend would hand the step (bf16 by default)

    @property
    def captured(self) -> tuple[int, ...]:
        """Layer ids computed, ascending: the aux layers and N (the files' slots)."""
        return tuple(sorted({*self.aux_layer_ids, self.cfg.num_hidden_layers}))

    def load(self, mesh) -> dict[str, jax.Array]:
        return load_params(self.folder, self.cfg, mesh, self.param_dtype)

    def abstract(self, mesh) -> dict[str, jax.ShapeDtypeStruct]:
        sh = param_shardings(self.cfg, mesh)
        return {
            n: jax.ShapeDtypeStruct(s.shape, held_dtype(n, self.param_dtype), sharding=sh[n])
            for n, s in param_specs(self.cfg).items()
        }

    def forward_flops(self, rows: int, seq_len: int) -> float:
        """Matmul FLOPs of the forward over ``rows`` rows of ``seq_len`` tokens, an upper
        bound: every row one causal document (packing only removes attention pairs)."""
        pairs = [
            sum(min(t + 1, w or t + 1) for t in range(seq_len)) for w in self.cfg.layer_windows
        ]
        return rows * self._flops(seq_len, pairs)

    def drafted_flops(self, rows: int, seq_len: int, num_anchors: int, block: int) -> float:
        """Matmul FLOPs of ``forward.drafted_hidden`` (Draft-OPD): the rows again and
        ``num_anchors`` blocks of ``block`` tokens per row, each seeing at most the whole
        row and its block (an upper bound)."""
        q = num_anchors * block
        pairs = [q * (seq_len + block)] * self.cfg.num_hidden_layers
        return self.forward_flops(rows, seq_len) + rows * self._flops(q, pairs)

    def _flops(self, tokens: int, pairs: list[int]) -> float:
        """Matmul FLOPs of ``tokens`` tokens through every layer, ``pairs[i]`` the
        query-key pairs of layer i."""
        c = self.cfg
        h, d, nh = c.hidden_size, c.head_dim, c.num_attention_heads
        nq, nkv = nh * d, c.num_key_value_heads * d
        if c.mla:  # q (through its latent), the kv latent, its expansion, o
            qk, q = nh * c.qk_head_dim, c.q_lora_rank
            proj = h * q + q * qk if q else h * qk
            kv = c.kv_lora_rank
            proj += h * (kv + c.qk_rope_head_dim) + kv * nh * (c.qk_nope_head_dim + c.v_head_dim)
            proj += nh * c.v_head_dim * h
            score = nh * (c.qk_head_dim + c.v_head_dim) / 2  # per pair: q.k and p v
        else:
            proj, score = h * (nq + 2 * nkv) + nq * h, nq
        total = 0.0
        for i in range(c.num_hidden_layers):
            if c.mixer(i) != "attention":
                total += tokens * self._linear_attention_flops(c.mixer(i))
            else:
                total += 2 * tokens * proj
                total += 4 * pairs[i] * score  # scores and P V
                if c.mla_output_gate:  # Kimi-K3's MLA gate
                    total += 2 * tokens * h * nh * c.v_head_dim
            if c.is_moe(i):
                e, k, mi = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
                eh = c.latent_moe or h  # Kimi-K3: experts in a latent, down and up
                total += 2 * tokens * (h * e + k * 3 * eh * mi + 3 * h * c.shared_width)
                total += 2 * tokens * 2 * h * eh if c.latent_moe else 0
            else:
                total += 2 * tokens * 3 * h * c.intermediate_size
            if c.attn_res_block is not None:  # two attention residuals: score and sum
                total += 2 * tokens * 2 * 2 * h * (i // c.attn_res_block + 2)
        return total

    def _linear_attention_flops(self, mixer: str, chunk: int = 64) -> float:
        """Matmul FLOPs per token of a KDA or Gated DeltaNet layer (verifier/delta_rule.py's
        chunked form): its projections; per value head, the chunk's pair products (its
        writes' matrix and the scores, C pairs of dk), the triangular solve (C^2/2), W's
        two products, and the state's three [dk, dv] products (read, write, out)."""
        c = self.cfg
        h, nv, dv, dk = c.hidden_size, c.linear_heads, c.linear_v_dim, c.linear_k_dim
        kd, vd = c.linear_k_heads * dk, nv * dv
        if mixer == "kda":  # q/k/v/o, the forget gate's and the output gate's pairs, beta
            proj = 2 * (4 * h * vd + 2 * (h * dv + dv * vd) + h * nv)
            if c.kda_full_rank_gate:  # Kimi-K3: the output gate one [vd, h] projection
                proj += 2 * (h * vd - (h * dv + dv * vd))
        else:  # in_proj_qkvz, in_proj_ba, out_proj
            proj = 2 * (h * (2 * kd + 2 * vd) + h * 2 * nv + vd * h)
        per_head = 2 * (2 * chunk * dk + chunk * chunk / 2 + chunk * (dk + dv) + 3 * dk * dv)
        return proj + nv * per_head

    def fill(self, params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> dict:
        """The batch with ``hidden_states`` [B, S, n_aux * H] (aux slots layer-major, in the
        drafter's aux order) and ``verifier_last_hidden_states`` [B, S, H] computed."""
        hs = batch_hidden_states(
            params, self.cfg, batch, self.captured, out_dtype=self.out_dtype
        )  # [B, S, n, H]
        cap = self.captured
        aux = jnp.stack([hs[:, :, cap.index(a)] for a in self.aux_layer_ids], axis=2)
        b, s = hs.shape[:2]
        out = dict(batch)
        out["hidden_states"] = aux.reshape(b, s, -1)
        out["verifier_last_hidden_states"] = hs[:, :, cap.index(self.cfg.num_hidden_layers)]
        return out


def build(
    folder: str,
    dcfg: DSparkConfig,
    verifier_dtype: str,
    hidden_states_dtype: str | None,
    *,
    check_tensors: bool = True,
) -> InStepVerifier:
    """Check the verifier folder against the drafter (one line per problem, nothing read
    beyond config.json and the safetensors headers) and describe the in-step verifier.
    ``check_tensors=False`` (``--dry-run --compile-for``): config.json alone is enough."""
    vcfg = load_verifier_config(folder)  # refuses unsupported families first
    where = f"{folder}/config.json"
    if vcfg.hidden_size != dcfg.verifier_hidden_size:
        raise InStepError(
            f"{where}: hidden_size {vcfg.hidden_size}, the drafter expects verifier hidden "
            f"size {dcfg.verifier_hidden_size}"
        )
    if vcfg.vocab_size != dcfg.vocab_size:
        raise InStepError(
            f"{where}: vocab_size {vcfg.vocab_size}, the drafter's vocab_size is "
            f"{dcfg.vocab_size} (another tokenizer?)"
        )
    aux = tuple(int(i) for i in dcfg.aux_hidden_state_layer_ids)
    vcfg.check_layer_ids(aux, "aux_hidden_state_layer_ids")
    if check_tensors:
        readers(Checkpoint(folder), vcfg)  # every tensor present with its shape
    if verifier_dtype not in DTYPES:
        raise InStepError(f"--verifier-dtype {verifier_dtype!r}: expected one of {list(DTYPES)}")
    out = DTYPES[hidden_states_dtype or "bfloat16"]
    return InStepVerifier(folder, vcfg, aux, DTYPES[verifier_dtype], out)


def check_token_ids(max_token_id: int, vcfg: VerifierConfig, data_path: str) -> None:
    """A prepared dataset made with another tokenizer has ids the verifier cannot embed."""
    if max_token_id >= vcfg.vocab_size:
        raise InStepError(
            f"{data_path}: token id {max_token_id} >= the verifier's vocab_size "
            f"{vcfg.vocab_size} (prepared with another tokenizer?)"
        )
