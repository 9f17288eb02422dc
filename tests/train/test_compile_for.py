"""``--dry-run --compile-for``: the trainer's steps compiled for a TPU slice from this
CPU machine (libtpu, the ``tpu`` extra), and for the local devices.

The TPU tests are marked ``tpu``: they skip without libtpu, and under CI=true (which
installs the extra) such a skip fails the run (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import shlex
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel
from dspark_jax.parallel import LOGICAL_RULES
from dspark_jax.train import compile_report, compile_target, flags
from dspark_jax.train import trainer as train

ROOT = Path(__file__).resolve().parents[2]


def _libtpu_missing() -> str | None:
    from jax._src import xla_bridge

    return None if xla_bridge.get_tpu_library_path() else "needs libtpu: the tpu extra"


def tiny_compile_argv(verifier, save, *extra) -> list[str]:
    """A 1-layer drafter (hidden 8) of the conftest verifier; no data folder exists."""
    return [
        "--verifier-name-or-path", str(verifier), "--target-layer-ids", "1", "2",
        "--mask-token-id", "1023", "--total-seq-len", "64", "--max-anchors", "6",
        "--block-size", "4", "--num-layers", "1", "--markov-rank", "4",
        "--loss-fn", '{"ce": 0.1, "tv": 0.9}', "--loss-chunk-tokens", "8",
        "--data-path", str(save / "no-data"), "--save-path", str(save / "ckpt"),
        "--dry-run", *extra,
    ]  # fmt: skip


@pytest.fixture
def captured(monkeypatch):
    """The CompiledSteps of each compile_report call (the CLI prints, tests inspect)."""
    seen: list[compile_report.CompiledSteps] = []
    real = compile_report.compile_steps

    def spy(trainer):
        seen.append(real(trainer))
        return seen[-1]

    monkeypatch.setattr(compile_report, "compile_steps", spy)
    return seen


def expected_spec(names, shape, mesh) -> P:
    """The logical-axis rule of each dimension; a dimension the mesh axes do not divide
    stays replicated (docs/design.md, "Logical axis rules")."""
    out = []
    for name, dim in zip(names, shape, strict=True):
        axis = LOGICAL_RULES[name] if name is not None else None
        if axis is not None and dim % mesh.shape[axis]:
            axis = None
        out.append(axis)
    return P(*out)


def check_parameter_shardings(steps: compile_report.CompiledSteps, abstract) -> int:
    """Every parameter's sharding in the compiled train and eval steps follows the
    rules; returns how many parameters are split over some mesh axis."""
    expected = {}
    for path, var in nnx.to_flat_state(abstract):
        names = var.get_metadata().get("out_sharding")
        assert names, f"{path}: no logical axis names"
        expected[path] = expected_spec(tuple(names), var.get_value().shape, steps.mesh)
    split = 0
    for compiled, params in (
        (steps.train_compiled, steps.train_compiled.input_shardings[0][0]["params"]),
        (steps.eval_compiled, steps.eval_compiled.input_shardings[0][0]),
    ):
        flat = dict(nnx.to_flat_state(params))
        assert flat.keys() == expected.keys()
        for path, want in expected.items():
            got = flat[path].get_value()
            ndim = len(want)
            assert got.is_equivalent_to(jax.sharding.NamedSharding(steps.mesh, want), ndim), (
                f"{'/'.join(map(str, path))}: compiled {got.spec}, rules say {want}"
            )
            split += compiled is steps.train_compiled and any(a is not None for a in want)
    return split


@pytest.mark.tpu
@pytest.mark.parametrize(
    "mesh, rows", [("fsdp=4", 4), ("data=2,fsdp=2", 8)], ids=["fsdp4", "data2_fsdp2"]
)
def test_compile_for_a_tpu_slice_reports_memory_and_shards_by_the_rules(
    verifier, tmp_path, capsys, captured, mesh, rows
):
    if why := _libtpu_missing():
        pytest.skip(why)
    argv = tiny_compile_argv(
        verifier, tmp_path, "--compile-for", "tpu:v5e:2x2", "--mesh", mesh,
        "--rows-per-step", str(rows),
    )  # fmt: skip
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    [steps] = captured
    sizes = dict(steps.mesh.shape)
    assert sizes == flags_mesh(mesh)
    assert {d.device_kind for d in steps.mesh.devices.flat} == {"TPU v5 lite"}
    assert steps.target.chips == 4 and steps.target.memory_per_device == 16 * 2**30
    assert steps.fits and steps.rows_per_step == rows

    # The report's fields, per chip, for both steps.
    header = next(line for line in out.splitlines() if line.startswith("[compile] compiled"))
    assert f"tpu:v5e:2x2 (4 devices, TPU v5 lite): mesh {sizes}" in header
    assert f"{rows} rows of 64 tokens per step ({rows // 4} per chip)" in header
    for step in (steps.train, steps.eval):
        assert step.error is None
        assert step.arguments > 0 and step.outputs > 0 and step.temporaries >= 0
        line = next(x for x in out.splitlines() if x.startswith(f"[compile] {step.name} step per"))
        gib = f"{step.total / 2**30:.2f} GiB of 16.00 GiB"
        assert gib in line and line.endswith(": fits"), line
        coll = next(x for x in out.splitlines() if x.startswith(f"[compile] {step.name} step coll"))
        assert step.collectives and all(f"{k} {v}" in coll for k, v in step.collectives.items())
    # Donation: the new state is written over the old; the eval step holds the optimizer.
    assert steps.train.aliased > 0 and steps.train.outputs >= steps.train.aliased
    assert steps.eval.aliased == 0 and steps.eval.resident > 0
    # FSDP gathers weights; gradients of the data-parallel rows are reduced.
    assert steps.train.collectives.get("all-gather", 0) > 0
    assert (
        steps.train.collectives.get("all-reduce", 0)
        + steps.train.collectives.get("reduce-scatter", 0)
        > 0
    )
    assert out.splitlines()[-1] == (
        f"[compile] fits: tpu:v5e:2x2 with --mesh {','.join(f'{k}={v}' for k, v in sizes.items())}"
        f" and --rows-per-step {rows}"
    )
    # Nothing initialised or written: shapes only.
    assert not (tmp_path / "ckpt").exists()

    # Each parameter's compiled input sharding is what the logical-axis rules give.
    trainer = train.Trainer(flags.resolve(argv), devices=list(steps.mesh.devices.flat))
    assert check_parameter_shardings(steps, trainer.abstract_state()[1]) > 0
    # Rows over (data, fsdp); the heads' embed dim over fsdp.
    batch_sh = steps.train_compiled.input_shardings[0][2]["input_ids"]
    assert batch_sh.is_equivalent_to(jax.sharding.NamedSharding(steps.mesh, P(("data", "fsdp"))), 2)
    head_sh = steps.train_compiled.input_shardings[0][1].lm_head
    assert head_sh.is_equivalent_to(jax.sharding.NamedSharding(steps.mesh, P("fsdp", None)), 2)


def flags_mesh(spec: str) -> dict[str, int]:
    sizes = {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}
    sizes.update({k: int(v) for k, v in (p.split("=") for p in spec.split(","))})
    return sizes


def test_a_step_that_does_not_fit_exits_1(monkeypatch, capsys):
    """Over the memory, or refused by the compiler (out of HBM): 'does not fit', status 1."""
    mesh = parallel.make_mesh("fsdp=1", jax.devices()[:1])
    target = compile_target.Target("tpu:v5e:2x2", (jax.devices()[0],), 1000, "test", chips=1)
    train_mem = compile_report.StepMemory("train", arguments=600, temporaries=500, outputs=10)
    oom = compile_report.StepMemory("eval", error="RESOURCE_EXHAUSTED: Ran out of memory in hbm")
    steps = compile_report.CompiledSteps(target, mesh, 1, train_mem, oom, None, None)
    assert train_mem.total == 1110 and not steps.fits
    args = types.SimpleNamespace(
        total_seq_len=64, loss_chunk_tokens=8, gradient_checkpointing=False
    )
    monkeypatch.setattr(compile_report, "compile_steps", lambda trainer: steps)
    # the train step compiled: the report adds its model FLOPs (the real trainer's cfg)
    monkeypatch.setattr(compile_report, "model_flops_per_chip", lambda trainer, chips: 2e12)
    assert compile_report.compile_report(types.SimpleNamespace(args=args)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("total 0.00 GiB of 0.00 GiB (test): does not fit")
    assert out[3] == (
        "[compile] eval step: does not fit: the compiler ran out of memory: "
        "RESOURCE_EXHAUSTED: Ran out of memory in hbm"
    )
    assert out[-1].startswith("[compile] does not fit: tpu:v5e:2x2 with --mesh")


def test_collectives_are_counted_from_optimised_hlo():
    hlo = """
  %all-gather-start.1 = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %p), dimensions={0}
  %all-gather-done.1 = f32[8]{0} all-gather-done((f32[2]{0}, f32[8]{0}) %all-gather-start.1)
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), to_apply=%add
  %rs.2 = f32[2]{0} reduce-scatter(f32[8]{0} %y), dimensions={0}
  %cp = f32[2]{0} collective-permute(f32[2]{0} %z), source_target_pairs={{0,1}}
  %fusion = f32[8]{0} fusion(f32[8]{0} %ar), kind=kLoop, calls=%all-reduce-like
"""
    assert compile_report.collectives(hlo) == {
        "all-gather": 1,
        "all-reduce": 1,
        "collective-permute": 1,
        "reduce-scatter": 1,
    }
    # Bytes: the gathered 8 floats, the reduced 8, the scattered input 8, the permuted 2.
    assert compile_report.collective_bytes(hlo) == {
        "all-gather": 32,
        "all-reduce": 32,
        "collective-permute": 8,
        "reduce-scatter": 32,
    }
    assert compile_report.collective_bytes(
        "%a = (bf16[4,2]{1,0}, bf16[16,2]{1,0}) all-gather-start(bf16[4,2]{1,0} %p)\n"
        "%b = f8e4m3fn[10]{0} all-to-all(f8e4m3fn[10]{0} %q), dimensions={0}"
    ) == {"all-gather": 64, "all-to-all": 10}


def test_compile_for_local_reports_the_local_devices(verifier, tmp_path, capsys, captured):
    argv = tiny_compile_argv(verifier, tmp_path, "--compile-for", "local", "--mesh", "fsdp=8")
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    [steps] = captured
    assert steps.target.chips == len(jax.devices()) == 8
    assert steps.target.memory_source == "host RAM / 8 devices"
    assert re.search(r"\[compile\] train step per chip: arguments .* total .* GiB of", out)
    assert out.splitlines()[-1].startswith("[compile] fits: local with --mesh data=1,fsdp=8")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--compile-for", "local"], "error: --compile-for local compiles the steps without "
         "training: add --dry-run"),
        (["--dry-run", "--compile-for", "tpu:v9x:2x2"], "error: --compile-for 'tpu:v9x:2x2': "
         "expected 'local', 'tpu:<generation>:<topology>'"),
        (["--dry-run", "--compile-for", "gpu:a100:8"], "error: --compile-for gpu:a100:8: "
         "'a100' is neither a GPU preset (h100, h200) nor a readable target-config file"),
    ],
    ids=["without-dry-run", "bad-target", "unknown-gpu"],
)  # fmt: skip
def test_compile_for_errors_are_one_line(verifier, tmp_path, capsys, extra, message):
    argv = [a for a in tiny_compile_argv(verifier, tmp_path) if a != "--dry-run"] + extra
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err


def test_compile_for_a_tpu_without_libtpu_names_the_extra(verifier, tmp_path, capsys, monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "get_tpu_library_path", lambda: None)
    compile_target.resolve.cache_clear()
    try:
        argv = tiny_compile_argv(verifier, tmp_path, "--compile-for", "tpu:v5p:2x2x1")
        assert train.main(argv) == 2
    finally:
        compile_target.resolve.cache_clear()
    err = capsys.readouterr().err.strip()
    assert (
        err == f"error: --compile-for tpu:v5p:2x2x1 needs libtpu, from {compile_target.TPU_EXTRA}"
    )
    assert "[tpu]" in err


def test_compile_for_a_gpu_without_the_cuda_plugin_names_the_extra(
    verifier, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(compile_target, "cuda_plugin_installed", lambda: False)
    compile_target.resolve.cache_clear()
    try:
        argv = tiny_compile_argv(verifier, tmp_path, "--compile-for", "gpu:h200:8")
        assert train.main(argv) == 2
    finally:
        compile_target.resolve.cache_clear()
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"error: --compile-for gpu:h200:8 needs the CUDA plugin, from {compile_target.CUDA_EXTRA}"
    )


def test_gpu_presets_are_target_configs_with_their_memory():
    text = compile_target.gpu_target_config("h200")
    assert "device_memory_size: 141000000000" in text and "core_count: 132" in text
    assert 'platform_name: "CUDA"' in text and "major: 9" in text


@pytest.mark.filterwarnings("ignore:--on-generate is deprecated")
def test_kimi_k3_config_holds_the_seed_runs_training_flags(monkeypatch):
    """configs/kimi_k3/train.yaml resolves as the seed command (docs/seed_run.md, §4)
    does, but for the paths and the extractor's addresses."""
    from tests.train.test_cli import SEED_FLAGS

    monkeypatch.chdir(ROOT)
    from_file = flags.resolve(["--config", "configs/kimi_k3/train.yaml"]).values
    seed = flags.resolve(
        shlex.split(
            SEED_FLAGS.format(verifier="v", draft_config="d.json", data="data", save="save")
        )
    ).values
    own = {"verifier_name_or_path", "draft_config", "data_path", "save_path", "on_generate"}
    own |= {"mooncake_master", "vllm_endpoint"}
    differ = {k for k in seed if seed[k] != from_file[k]} - own
    assert not differ, {k: (seed[k], from_file[k]) for k in differ}


def test_kimi_k3_config_builds_the_published_drafter_from_config_files_only(monkeypatch):
    """From a fresh clone: the stand-in verifier has no weights and no data exists, yet the
    run resolves to the Kimi-K3 drafter (docs/seed_run.md: ~2.4B trainable parameters)."""
    monkeypatch.chdir(ROOT)
    args = flags.resolve(["--config", "configs/kimi_k3/train.yaml", "--dry-run"])
    trainer = train.Trainer(args, devices=jax.devices()[:1])
    cfg = trainer.cfg
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (5, 7168, 14336)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (96, 16, 64)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.verifier_hidden_size) == (163840,) * 2 + (
        7168,
    )
    assert cfg.aux_hidden_state_layer_ids == (24, 48, 72, 88, 92)
    n = sum(x.size for x in jax.tree.leaves(trainer.abstract_state()[1]))
    assert n == 2_396_090_241
    assert not list((ROOT / "configs" / "kimi_k3" / "verifier").glob("*.safetensors"))


def test_compile_for_a_reduced_vocabulary_needs_no_vocab_maps(verifier, tmp_path):
    """Shapes only: without the data's d2t/t2d, --compile-for compiles with stand-in maps
    of the same sizes; a training run (or a plain --dry-run) still needs the real ones."""
    argv = tiny_compile_argv(verifier, tmp_path, "--draft-vocab-size", "512")
    with pytest.raises(flags.ConfigError, match="draft_vocab_size=512 needs vocab maps"):
        train.Trainer(flags.resolve(argv))
    trainer = train.Trainer(flags.resolve([*argv, "--compile-for", "local"]))
    d2t, t2d = trainer.setup.vocab_maps
    assert trainer.cfg.draft_vocab_size == 512 and d2t.shape == (512,) and t2d.sum() == 512
    assert not (tmp_path / "no-data").exists()  # nothing cached into a data folder


@pytest.mark.cuda_compile
def test_compile_for_gpus_without_a_gpu(verifier, tmp_path, capsys, captured):
    """The CUDA plugin's deviceless path (docs/tpu.md, "GPU targets"); runs where the
    plugin is installed (the cuda or cuda-compile extra; CI installs cuda-compile, and
    under CI=true a skip here fails)."""
    if not compile_target.cuda_plugin_installed():
        pytest.skip("needs the CUDA plugin: the cuda-compile extra")
    argv = tiny_compile_argv(
        verifier, tmp_path, "--compile-for", "gpu:h200:2x2", "--mesh", "data=2,fsdp=2"
    )
    assert train.main(argv) == 0
    [steps] = captured
    assert {d.device_kind for d in steps.mesh.devices.flat} == {"NVIDIA H200"}
    assert steps.target.chips == 4 and steps.target.memory_per_device == 141 * 10**9
    assert steps.fits and steps.train.arguments > 0 and steps.train.collectives
    assert check_parameter_shardings(steps, train.Trainer(
        flags.resolve(argv), devices=list(steps.mesh.devices.flat)
    ).abstract_state()[1]) > 0  # fmt: skip
    assert (
        "[compile] fits: gpu:h200:2x2 with --mesh data=2,fsdp=2,context=1,tensor=1"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("accelerator, preset", [(False, None), (True, None), (False, "tpu")])
def test_commands_use_the_cpu_backend_on_machines_without_an_accelerator(
    monkeypatch, accelerator, preset
):
    """With libtpu installed (the tpu extra) JAX would try a TPU backend first and print
    libtpu's errors; on a machine with neither TPU nor GPU every command asks for CPU,
    in the environment and, as JAX is imported already, in its config."""
    from dspark_jax import cli

    if preset is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", preset)
    monkeypatch.setattr(cli, "_has_accelerator", lambda: accelerator)
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    assert cli.guarded(lambda argv: 0, []) == 0
    if accelerator or preset:
        assert os.environ.get("JAX_PLATFORMS") == preset and updates == []
    else:
        assert os.environ["JAX_PLATFORMS"] == "cpu" and updates == [("jax_platforms", "cpu")]


@pytest.mark.tpu
def test_the_seed_mesh_fits_a_v5p_128_by_splitting_a_physical_axis():
    """data=8,fsdp=8 on a 4x4x4 v5p: 8 is no product of the physical axes (4, 4, 4), which
    jax.make_mesh refuses outside v5e; the mesh splits one instead."""
    if why := _libtpu_missing():
        pytest.skip(why)
    devices = compile_target.resolve("tpu:v5p:4x4x4").devices
    mesh = parallel.make_mesh("data=8,fsdp=8", list(devices))
    assert dict(mesh.shape) == {"data": 8, "fsdp": 8, "context": 1, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    # Each data-parallel group of 8 is a 2x4 block of neighbouring chips, not scattered.
    for group in mesh.devices.reshape(8, 8):
        coords = np.array([d.coords for d in group])
        assert np.prod(np.ptp(coords, axis=0) + 1) == 8


@pytest.mark.tpu
@pytest.mark.parametrize(
    "mesh, rows, tokens",
    [
        ("context=8", 1, [(0, 32), (32, 64)]),  # jax.make_mesh alone interleaves the hosts
        ("fsdp=2,context=4", 2, [(0, 64), (0, 64)]),  # each host: one row whole
        ("fsdp=4,context=2", 4, [(0, 64), (0, 64)]),
    ],
)
def test_a_row_split_over_hosts_gives_each_host_one_token_range(mesh, rows, tokens):
    """A v5p-16 is 2 hosts of 4 chips: make_mesh orders each context group by process,
    so every host builds one token range of its rows (what the pipeline can feed)."""
    if why := _libtpu_missing():
        pytest.skip(why)
    devices = compile_target.resolve("tpu:v5p:2x2x2").devices
    m = parallel.make_mesh(mesh, devices)
    parallel.check_context_split(m, 64, rows)
    for p in (0, 1):
        assert parallel.process_rows(m, rows, 64, p)[1] == tokens[p], (mesh, p)
