"""Every verifier family users bring, end to end against speculators 0.9.0: a tiny
verifier config built with the family's transformers config class -> the draft config
derived from it (ours: dspark_jax.train.drafter_setup; the reference's:
``create_transformer_layer_config``) -> loss, metrics and parameter gradients on the
same weights and rows -> export -> ``converters check`` for vLLM.

The families cover every rope type the draft layers carry (llama3, linear, dynamic,
longrope on Llama configs; yarn on gpt-oss, DeepSeek-V3 and Kimi; MRoPE on Qwen3.5;
per-layer-type rope on Gemma 3; partial rotary on GLM) and both verifier-norm
conventions (Gemma 3 and Qwen3.5 are x * (1 + w)). Each family runs a "short" row
(every position + 1 <= 16: below every original context length here) and a "long" one
(positions up to 39: past the original context of llama3, yarn and longrope (16) and the
dynamic family's max_position_embeddings (24)).

One compilation serves all families of a norm convention: the draft shapes are equal,
and the rope enters the jitted step as ``RopeTables`` arrays (the canonical graph's
config differs from a family's only in fields the graph does not read, asserted below).

Tolerances (fp32, CPU), as in test_model_parity.py: both sides evaluate the same fp32
graph with other summation orders (online-softmax vs dense attention, chunked vs full
vocabulary reductions); ours and the reference's fp32 run must both lie within the fp32
round-off bound of the reference's float64 run (``FWD_DEPTH``, ``BWD_DEPTH`` below:
the drafter's chain plus the rope angles' 1-ulp frequency differences), 1.6e-5 of the
largest logit for the loss and metrics and 2.5e-5 of each gradient tensor's largest
entry (the old rtol 1e-5 / 1e-4 per value stated no bound). A flipped norm convention
moves the targets by O(1) (the gain is w or 1 + w, w ~ 0.1): test_gemma_norm_flip_is_caught.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("speculators")
pytestmark = pytest.mark.reference

from flax import nnx  # noqa: E402

from dspark_jax.config import DSparkConfig, RopeScaling  # noqa: E402
from dspark_jax.convert.check import check_folder  # noqa: E402
from dspark_jax.convert.export import export_params  # noqa: E402
from dspark_jax.model.draft import (  # noqa: E402
    DSparkDraftModel,
    FrozenWeights,
    LossSettings,
    row_loss,
)
from dspark_jax.model.layers import rope_frequencies, rope_tables  # noqa: E402
from dspark_jax.model.params import to_speculators  # noqa: E402
from dspark_jax.train import drafter_setup  # noqa: E402
from dspark_jax.train import flags as cli  # noqa: E402
from launch.speculators_config import reference_config  # noqa: E402
from tests.numerics import DRAFTER_DEPTH  # noqa: E402
from tests.reference.harness import (  # noqa: E402
    LAMBDA,
    assert_fp32_parity,
    build_reference_model,
    run_reference,
)

torch = pytest.importorskip("torch")

VT, H, SEQ, NUM_ANCHORS = 64, 32, 48, 8
ROWS = {"short": (12, 12, 12), "long": (36, 6)}  # document lengths; the rest is padding
LOSS_FN = '{"ce":0.1,"tv":0.9}'
# Shared by every family: the derived draft shapes are then equal (head_dim 8, MLP 64).
COMMON = dict(
    vocab_size=VT,
    hidden_size=H,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,
    rms_norm_eps=1e-6,
)
# The fp32 round-off bound (harness.assert_fp32_parity, LAMBDA sqrt(n) U scale) of
# test_model_parity.py: these drafts are tests.numerics' tiny_config shape or smaller
# (hidden 32, MLP 64, 4 x 8 heads, <= 48 keys, 2 layers, 2 aux layers, vocab 64, r 8), so
# DRAFTER_DEPTH bounds the chain. Plus the rope: transformers computes cos/sin in fp32
# whatever the model dtype (so the float64 run has the reference fp32 run's angles), and
# our inverse frequencies are bit-equal to its or 1 ulp apart (numpy's and torch's pow;
# test_rope_tables_match_transformers): angles p f within 2 U p f <= 2 U 39 (positions
# < 40, f <= 1), so rotated q and k within ROPE_U = 78 U of their magnitude, a systematic
# error added linearly: (LAMBDA sqrt(n) + ROPE_U) U scale = LAMBDA sqrt(n') U scale.
ROPE_U = 2 * 39
FWD_DEPTH = math.ceil((math.sqrt(DRAFTER_DEPTH) + ROPE_U / LAMBDA) ** 2)  # 2025
BWD_DEPTH = math.ceil((math.sqrt(2 * DRAFTER_DEPTH) + 2 * ROPE_U / LAMBDA) ** 2)  # 5078
LONGROPE = dict(short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.5, 2.0, 4.0, 8.0])


def _llama(rope_parameters, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        **COMMON, intermediate_size=64, head_dim=8, **kw, rope_parameters=rope_parameters
    )


def _as_legacy_json(d: dict, rope_type: str) -> dict:
    """A transformers 4 config.json (rope_theta + rope_scaling with 'type'), as many
    Hub checkpoints still ship."""
    rope = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = {"type": rope_type, **{k: v for k, v in rope.items() if k != "rope_type"}}
    return d


def _without_head_dim(d: dict) -> dict:
    """MLA Hub configs have no head_dim (their config class sets qk_rope_head_dim)."""
    d.pop("head_dim", None)
    return d


def family_configs():
    """name -> (transformers config, config.json rewrite or None, expected norm style)."""
    from transformers import (
        DeepseekV3Config,
        Gemma3Config,
        Glm4MoeConfig,
        GptOssConfig,
        Qwen3MoeConfig,
    )
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    mla = dict(
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16
    )
    yarn = dict(rope_type="yarn", rope_theta=10.0, factor=4.0, original_max_position_embeddings=16)

    def kimi_json(d):
        tc = _without_head_dim(d["text_config"])
        tc["model_type"] = "kimi_k2"  # the Hub's name; transformers maps it to deepseek_v3
        d["text_config"] = _as_legacy_json(tc, "yarn")
        return d

    return {
        "llama3": (
            _llama(
                dict(
                    rope_type="llama3",
                    rope_theta=100.0,
                    factor=4.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=16,
                ),
                max_position_embeddings=64,
            ),
            None,
            "plain",
        ),
        "llama-linear-legacy": (
            _llama(dict(rope_type="linear", rope_theta=500.0, factor=2.0)),
            lambda d: _as_legacy_json(d, "linear"),
            "plain",
        ),
        "llama-dynamic": (
            _llama(
                dict(rope_type="dynamic", rope_theta=100.0, factor=3.0), max_position_embeddings=24
            ),
            None,
            "plain",
        ),
        "llama-longrope": (
            # factor 2 != max/original = 4: transformers' and vLLM's default scalings
            # differ, so the export must carry short/long_mscale.
            _llama(
                dict(
                    rope_type="longrope",
                    rope_theta=100.0,
                    factor=2.0,
                    original_max_position_embeddings=16,
                    **LONGROPE,
                ),
                max_position_embeddings=64,
            ),
            None,
            "plain",
        ),
        "gemma3": (
            Gemma3Config(text_config=dict(**COMMON, intermediate_size=64, head_dim=8)),
            None,
            "gemma",
        ),
        "gpt-oss": (
            GptOssConfig(
                **COMMON,
                intermediate_size=64,
                head_dim=8,
                max_position_embeddings=64,
                rope_parameters={**yarn, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
            ),
            None,
            "plain",
        ),
        "qwen3-moe": (Qwen3MoeConfig(**COMMON, intermediate_size=64, head_dim=8), None, "plain"),
        "qwen3.5": (
            Qwen3_5Config(
                text_config=dict(
                    **COMMON,
                    intermediate_size=64,
                    head_dim=8,
                    rope_parameters=dict(
                        rope_type="default",
                        rope_theta=1e4,
                        mrope_section=[1, 1, 0],
                        mrope_interleaved=True,
                        partial_rotary_factor=0.5,
                    ),
                )
            ),
            None,
            "gemma",
        ),
        "deepseek-v3": (
            DeepseekV3Config(
                **COMMON,
                **mla,
                intermediate_size=64,
                max_position_embeddings=64,
                rope_parameters={**yarn, "mscale": 1.0, "mscale_all_dim": 0.707},
            ),
            _without_head_dim,
            "plain",
        ),
        "kimi": (
            Kimi_K25Config(
                text_config=dict(
                    **COMMON,
                    **mla,
                    intermediate_size=64,
                    max_position_embeddings=64,
                    rope_parameters={**yarn, "factor": 2.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                )
            ),
            kimi_json,
            "plain",
        ),
        "glm4-moe": (
            Glm4MoeConfig(**COMMON, intermediate_size=64, head_dim=8, partial_rotary_factor=0.5),
            None,
            "plain",
        ),
    }


FAMILIES = (
    "llama3",
    "llama-linear-legacy",
    "llama-dynamic",
    "llama-longrope",
    "gemma3",
    "gpt-oss",
    "qwen3-moe",
    "qwen3.5",
    "deepseek-v3",
    "kimi",
    "glm4-moe",
)
PAST_ORIGINAL_CONTEXT = ("llama3", "llama-longrope", "gpt-oss", "deepseek-v3", "kimi")


def write_verifier(folder: Path, config, rewrite) -> Path:
    folder.mkdir(parents=True)
    d = config.to_dict()
    d = rewrite(d) if rewrite else d
    (folder / "config.json").write_text(json.dumps(d, indent=1))
    return folder


def derive(folder: Path, tmp: Path) -> DSparkConfig:
    args = cli.resolve(
        [
            "--verifier-name-or-path", str(folder), "--data-path", str(tmp),
            "--num-layers", "2", "--full-attention-indices", "1", "--sliding-window", "6",
            "--target-layer-ids", "1", "3", "--mask-token-id", str(VT - 1),
            "--block-size", "4", "--markov-rank", "8",
        ]
    )  # fmt: skip
    return drafter_setup.build_draft(args).cfg


def reference_draft(folder: Path):
    from speculators.train.cli import create_transformer_layer_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_transformer_layer_config(str(folder), 2, "qwen3", "silu", 6, [1])


def canonical(cfg: DSparkConfig) -> DSparkConfig:
    """The family's config with the fields the compiled graph does not read (the rope
    enters as RopeTables) set to fixed values: equal across families of one style."""
    return cfg.replace(
        rope_theta=1e4,
        rope_scaling=RopeScaling(),
        max_position_embeddings=32768,
        verifier_name_or_path=None,
        verifier_architectures=(),
    )


def assert_same_draft(cfg: DSparkConfig, ref_tl) -> None:
    """Our derived draft layers are the reference's (ours adds vLLM's longrope scalings)."""
    ours = cfg.transformer_layer_dict()
    for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_hidden_layers", "layer_types", "sliding_window",
        "max_position_embeddings", "rms_norm_eps", "vocab_size", "hidden_act",
    ):  # fmt: skip
        assert ours[key] == getattr(ref_tl, key), key
    served_only = ("short_mscale", "long_mscale")
    rope = {k: v for k, v in ours["rope_parameters"].items() if k not in served_only}
    assert rope == ref_tl.rope_parameters


@functools.partial(jax.jit, static_argnums=(0, 1))
def loss_and_grads(graphdef, settings, state, frozen, row, anchors, valid, rope):
    def loss(st):
        return row_loss(nnx.merge(graphdef, st), frozen, row, anchors, valid, settings, rope)

    return jax.value_and_grad(loss, has_aux=True)(state)


def make_row(rng: np.random.Generator, docs: tuple[int, ...]) -> dict[str, np.ndarray]:
    pos, doc, mask = [], [], []
    for d, n in enumerate(docs):
        pos += list(range(n))
        doc += [d] * n
        mask += [0] * 3 + [1] * (n - 4) + [0]  # a prompt, a supervised reply, an end token
    pad = SEQ - len(pos)
    return {
        "hidden_states": rng.standard_normal((SEQ, 2 * H)).astype(np.float32),
        "verifier_last_hidden_states": rng.standard_normal((SEQ, H)).astype(np.float32) * 2,
        "input_ids": rng.integers(0, VT - 1, SEQ).astype(np.int64),
        "loss_mask": np.asarray(mask + [0] * pad, np.int64),
        "position_ids": np.asarray(pos + [0] * pad, np.int64),
        "document_ids": np.asarray(doc + [-1] * pad, np.int64),
    }


def make_anchors(row, rng: np.random.Generator, block: int):
    """Sorted valid anchors, among them each document's last (its block runs past the
    document's end and holds the row's largest position), then two padding ones."""
    eligible = np.flatnonzero((row["loss_mask"] > 0) & (np.arange(SEQ) < SEQ - block))
    doc = row["document_ids"][eligible]
    last = {int(eligible[doc == d][-1]) for d in np.unique(doc)}
    rest = [int(p) for p in eligible if p not in last]
    chosen = sorted(
        last | set(rng.choice(rest, NUM_ANCHORS - 2 - len(last), replace=False).tolist())
    )
    anchors = np.zeros(NUM_ANCHORS, np.int64)
    valid = np.zeros(NUM_ANCHORS, bool)
    anchors[: len(chosen)], valid[: len(chosen)] = chosen, True
    return anchors, valid


@pytest.fixture(scope="module")
def verifiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        name: (write_verifier(root / name, config, rewrite), style)
        for name, (config, rewrite, style) in family_configs().items()
    }


@pytest.fixture(scope="module")
def settings():
    return LossSettings.from_loss_fn(LOSS_FN, num_anchors=NUM_ANCHORS, vocab_chunk_tokens=12)


@pytest.fixture(scope="module")
def graphdefs():
    """One graph per norm convention (models built once, configs canonical)."""
    return {}


def family_run(name, verifiers, graphdefs, settings, tmp_path, *, flip_norm=False):
    folder, style = verifiers[name]
    cfg = derive(folder, tmp_path)
    assert cfg.verifier_norm_style == style
    ref_tl = reference_draft(folder)
    ref_cfg = reference_config(cfg, ref_tl, verifier=str(folder))

    assert_same_draft(cfg, ref_tl)
    from speculators.models.utils import uses_gemma_style_final_norm

    assert uses_gemma_style_final_norm(ref_cfg) == (style == "gemma")

    rng = np.random.default_rng(sum(map(ord, name)))
    model = DSparkDraftModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=False)
    params = nnx.state(model, nnx.Param)
    params = jax.tree.map(
        lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), params
    )
    nnx.update(model, params)
    # A Gemma-style weight is stored zero-centred (gain 1 + w), a plain one around 1.
    gain = 0.1 * rng.standard_normal(H) + (0.0 if style == "gemma" else 1.0)
    frozen = FrozenWeights(
        embed_tokens=rng.standard_normal((VT, H)).astype(np.float32),
        lm_head=(rng.standard_normal((H, VT)) * 0.3).astype(np.float32),
        verifier_lm_head=None,
        verifier_norm=gain.astype(np.float32),
    )
    frozen = frozen._replace(verifier_lm_head=frozen.lm_head)
    ref_model = build_reference_model(cfg, nnx.state(model, nnx.Param), frozen, ref_config=ref_cfg)
    ref_model64 = copy.deepcopy(ref_model).double()

    run_style = ("plain" if style == "gemma" else "gemma") if flip_norm else style
    canon = canonical(cfg).replace(verifier_norm_style=run_style)
    if canon not in graphdefs:
        graphdefs[canon] = nnx.split(
            DSparkDraftModel(canon, rngs=nnx.Rngs(0), dtype=jnp.float32, remat=False)
        )[0]
    tables = rope_tables(cfg)
    jfrozen = FrozenWeights(*(jnp.asarray(x) for x in frozen))
    results = []
    for row_name, docs in ROWS.items():  # short first: the reference's dynamic rope caches
        row = make_row(rng, docs)
        anchors, valid = make_anchors(row, rng, cfg.block_size)
        ref = run_reference(ref_model, row, anchors, valid, loss_fn=LOSS_FN)
        ref64 = run_reference(  # the exact values (harness.assert_fp32_parity)
            ref_model64, row, anchors, valid, loss_fn=LOSS_FN, dtype=torch.float64
        )
        jrow = {
            k: jnp.asarray(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in row.items()
        }
        (loss, metrics), grads = loss_and_grads(
            graphdefs[canon],
            settings,
            params,
            jfrozen,
            jrow,
            jnp.asarray(anchors, jnp.int32),
            jnp.asarray(valid),
            tables,
        )
        results.append((row_name, row, ref, float(loss), metrics, to_speculators(grads), ref64))
    return cfg, model, results


def assert_matches(results):
    """Ours and the reference's fp32 run within the fp32 round-off bound of the
    reference's float64 run, as test_model_parity.py (module docstring)."""
    fwd, bwd = FWD_DEPTH, BWD_DEPTH
    for row_name, _, ref, loss, metrics, grads, ref64 in results:
        logit_scale = float(np.abs(ref64.logits).max())
        assert_fp32_parity(loss, float(ref.loss), float(ref64.loss), fwd, row_name, logit_scale)
        assert set(metrics) == set(ref.metrics)
        for k, v in ref64.metrics.items():
            scale = max(abs(v), logit_scale)
            assert_fp32_parity(float(metrics[k]), ref.metrics[k], v, fwd, f"{row_name} {k}", scale)
        assert set(grads) == set(ref.grads), set(grads) ^ set(ref.grads)
        for k, g in ref64.grads.items():
            assert_fp32_parity(grads[k], ref.grads[k], g, bwd, f"{row_name} {k}")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_reference_and_exports(name, verifiers, graphdefs, settings, tmp_path):
    cfg, model, results = family_run(name, verifiers, graphdefs, settings, tmp_path)
    assert_matches(results)
    if name in PAST_ORIGINAL_CONTEXT:
        original = cfg.rope_scaling.get("original_max_position_embeddings")
        long_row = results[1][1]
        assert long_row["position_ids"].max() >= original, (
            "the long row must pass the original context"
        )
    if name == "llama-dynamic":  # the long row is rescaled, the short one is not
        tables = rope_tables(cfg)
        assert np.array_equal(rope_frequencies(tables, jnp.int32(15)), tables.inv_freq)
        assert not np.allclose(rope_frequencies(tables, jnp.int32(40)), tables.inv_freq)

    out = tmp_path / "export"
    report = export_params(cfg, nnx.state(model, nnx.Param), out)
    assert report.ok, report.format()
    assert check_folder(out).ok
    assert DSparkConfig.load_json(out) == cfg
    rope = json.loads((out / "config.json").read_text())["transformer_layer_config"][
        "rope_parameters"
    ]
    if name == "llama-longrope":  # vLLM must scale cos/sin as transformers did
        scaling = cfg.rope_scaling.attention_scaling(cfg.max_position_embeddings)
        assert rope["short_mscale"] == rope["long_mscale"] == pytest.approx(scaling, rel=1e-12)
    if name == "qwen3.5":  # MRoPE: sections rescaled to the full head, trained text-only
        assert rope["mrope_section"] == [2, 2, 0] and rope["partial_rotary_factor"] == 1.0


def test_gemma_norm_flip_is_caught(verifiers, graphdefs, settings, tmp_path):
    """With the other norm convention the loss moves far outside the tolerances."""
    _, _, results = family_run("gemma3", verifiers, graphdefs, settings, tmp_path, flip_norm=True)
    for _, _, ref, loss, _, _, _ in results:
        assert abs(loss - float(ref.loss)) > 100 * 1e-5 * abs(float(ref.loss))


# ----------------------------------------------------------------- config-only checks
def test_rope_tables_match_transformers():
    """Inverse frequencies and attention scaling of every rope type, at lengths below and
    past the thresholds, against transformers' Qwen3RotaryEmbedding. numpy's and torch's
    fp32 pow may each be 1 ulp off the exact power (everything else is the same correctly
    rounded ops in the same order): at most 2 ulps apart, rtol 2.4e-7."""
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dspark_jax.config import rope_scaling_from_dict
    from tests.tiny_configs import base_config

    cases = [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 3.0},
        {"rope_type": "dynamic", "factor": 2.5},
        {"rope_type": "yarn", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "truncate": False, "beta_fast": 8.0, "beta_slow": 0.5},
        {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.707},
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "longrope", "factor": 2.0, **LONGROPE},
        {"rope_type": "longrope", **LONGROPE},
        {"rope_type": "proportional", "factor": 2.0},
    ]
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for theta in (100.0, 1e6):
        for case in cases:
            rope = dict(case, original_max_position_embeddings=16) if case["rope_type"] in (
                "yarn", "llama3", "longrope"
            ) else case  # fmt: skip
            scaling = rope_scaling_from_dict(rope, 24)
            cfg = base_config(rope_theta=theta, max_position_embeddings=24, rope_scaling=scaling)
            tl = {
                k: v
                for k, v in cfg.transformer_layer_dict().items()
                if k not in ("model_type", "architectures")
            }
            ref = Qwen3RotaryEmbedding(Qwen3Config(**tl))
            tables = rope_tables(cfg)
            assert float(tables.attention_scaling) == np.float32(ref.attention_scaling), case
            for n in (8, 16, 17, 24, 25, 60):  # below and past 16 (original) and 24 (max)
                ref(torch.zeros(1), torch.arange(n)[None])  # the reference updates on a call
                ours = np.asarray(rope_frequencies(tables, jnp.int32(n)))
                np.testing.assert_allclose(
                    ours, ref.inv_freq.numpy(), rtol=2.4e-7, atol=0, err_msg=f"{case} n={n}"
                )


def test_derivations_without_a_parity_run(tmp_path):
    """Derived draft configs of other shapes, against the reference's: Qwen3.5-MoE has no
    dense intermediate_size (3 x hidden) and is not in speculators' norm list (plain);
    MLA configs without head_dim whose qk_rope_head_dim (DeepSeek) or qk_nope + qk_rope
    (Mistral 4) differs from hidden / heads. Refusals name what to pass instead."""
    from transformers import DeepseekV3Config
    from transformers.models.mistral4.configuration_mistral4 import Mistral4Config
    from transformers.models.phi3.configuration_phi3 import Phi3Config
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    moe = Qwen3_5MoeConfig(text_config=dict(**COMMON, head_dim=8))
    mla = dict(
        COMMON, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=16, q_lora_rank=16
    )
    deepseek = DeepseekV3Config(**mla, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    mistral = Mistral4Config(**mla, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    for name, config in (("moe", moe), ("deepseek", deepseek), ("mistral4", mistral)):
        folder = write_verifier(tmp_path / name, config, _without_head_dim)
        cfg = derive(folder, tmp_path)
        assert_same_draft(cfg, reference_draft(folder))
        assert cfg.verifier_norm_style == "plain"
    assert cfg.head_dim == 8 and cfg.num_attention_heads == 8  # not hidden / heads = 4
    moe_cfg = derive(tmp_path / "moe", tmp_path)
    assert moe_cfg.intermediate_size == 3 * H

    # Phi-4-mini style: longrope factors for 3/4 of the head, which the draft rotates whole.
    phi = Phi3Config(
        **COMMON,
        intermediate_size=64,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        partial_rotary_factor=0.5,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=1e4, short_factor=[1.0, 1.1], long_factor=[2.0, 4.0]
        ),
    )
    folder = write_verifier(tmp_path / "phi", phi, None)
    with pytest.raises(
        cli.ConfigError, match=r"short_factor has 2 entries, expected head_dim // 2 = 4"
    ):
        derive(folder, tmp_path)

    qwen35 = write_verifier(tmp_path / "q35", family_configs()["qwen3.5"][0], None)
    args = cli.resolve(
        ["--verifier-name-or-path", str(qwen35), "--data-path", str(tmp_path),
         "--mask-token-id", "1", "--target-layer-ids", "1", "--no-draft-mrope-full-head-hack"]
    )  # fmt: skip
    with pytest.raises(cli.ConfigError, match=r"drop --no-draft-mrope-full-head-hack"):
        drafter_setup.build_draft(args)
    args = cli.resolve(
        ["--verifier-name-or-path", str(qwen35), "--data-path", str(tmp_path),
         "--mask-token-id", "1", "--target-layer-ids", "1", "--verifier-norm-style", "plain"]
    )  # fmt: skip
    assert drafter_setup.build_draft(args).cfg.verifier_norm_style == "plain"
