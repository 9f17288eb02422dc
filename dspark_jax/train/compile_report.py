"""``--dry-run --compile-for``: compile the trainer's steps for a target, report memory.

MaxText's ``train_compile.py`` is the model: compile ahead of time for the target's
devices, print the memory per chip and fail before a pod is booked. The run is
resolved as for training (drafter config, vocab, loss and optimizer flags), the mesh
is built over the target's devices (``compile_target``), and the trainer's own jitted
steps (``Trainer._compile``: the same functions, shardings and donation) are lowered
from shapes and compiled; nothing is initialised, no verifier weights and no data
are read.

Per device (the compiled SPMD program's ``memory_analysis()``): arguments (state,
frozen verifier tensors, one batch), temporaries, outputs, aliases (the donated state)
and their total, against the target's memory; the collectives in the optimised HLO
(count and bytes) and the step's FLOPs (the compiler's count and the model's);
whether it fits. The eval step runs while the optimizer state stays resident, so its
total counts that state too. Exit status 1 when a step does not fit, or when the TPU
compiler itself runs out of HBM (its message is printed).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import hf_folder, optim, parallel
from dspark_jax.model.draft import FrozenWeights
from dspark_jax.train import compile_target
from dspark_jax.verifier.weights import param_specs

GIB = 2**30
COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",  # the experts' exchange (verifier/experts.py)
    "collective-permute",
    "collective-broadcast",
)
# An HLO instruction's opcode: `%name = type opcode(` (async pairs: opcode-start).
_OPCODE = re.compile(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(")
# An array type in HLO text, e.g. bf16[4096,512]{1,0}: element type and dims.
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_ELEMENT_BITS = {"pred": 8, "bf16": 16}
# The TPU compiler's out-of-memory error (RESOURCE_EXHAUSTED ... "Ran out of memory").
_OOM = ("RESOURCE_EXHAUSTED", "Ran out of memory", "exceeds the memory")
HF_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass
class StepMemory:
    """Per-device bytes of one compiled step."""

    name: str
    arguments: int = 0
    temporaries: int = 0
    outputs: int = 0
    aliased: int = 0  # outputs written into donated arguments
    resident: int = 0  # held during the step but not an argument (eval: optimizer state)
    shared: int = 0  # arguments passed twice as one buffer (the heads), counted once
    code: int = 0
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    flops: float | None = None  # XLA's cost analysis of the per-device program
    error: str | None = None  # the compiler refused (out of memory)

    @property
    def total(self) -> int:
        return (
            self.arguments
            - self.shared
            + self.temporaries
            + self.outputs
            - self.aliased
            + self.resident
            + self.code
        )


@dataclasses.dataclass
class CompiledSteps:
    """What the report is made of (tests read the compiled executables)."""

    target: compile_target.Target
    mesh: jax.sharding.Mesh
    rows_per_step: int
    train: StepMemory
    eval: StepMemory
    state_shardings: Any
    frozen_shardings: Any
    train_compiled: Any = None
    eval_compiled: Any = None

    @property
    def fits(self) -> bool:
        return all(
            s.error is None and s.total <= self.target.memory_per_device
            for s in (self.train, self.eval)
        )


def frozen_dtype(verifier_path: str):
    """The verifier's stored dtype (config.json ``torch_dtype``/``dtype``; bf16 if unset):
    the frozen tensors stay as stored."""
    try:
        d = json.loads((Path(verifier_path) / "config.json").read_text())
    except (OSError, ValueError):
        d = {}
    d = hf_folder.text_config(d)
    name = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
    return HF_DTYPES.get(str(name), jnp.bfloat16)


def _shaped(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _bytes_per_device(x: jax.ShapeDtypeStruct) -> int:
    shard = x.sharding.shard_shape(x.shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _collective_lines(hlo_text: str):
    """(line, opcode match) of each collective op in optimised HLO text; an async op once
    (its ``-start``, not its ``-done``)."""
    for line in hlo_text.splitlines():
        m = _OPCODE.search(line)
        if m and not m.group(1).endswith("-done"):
            if m.group(1).removesuffix("-start") in COLLECTIVES:
                yield line, m


def collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops in optimised HLO text, by kind (async start/done counted once)."""
    found = Counter(m.group(1).removesuffix("-start") for _, m in _collective_lines(hlo_text))
    return dict(sorted(found.items()))


def _array_bytes(text: str) -> int:
    """Bytes of the array types in a piece of HLO text (tuples: their elements)."""
    total = 0
    for kind, dims in _ARRAY.findall(text):
        bits = _ELEMENT_BITS.get(kind) or int(re.sub(r"\D", "", kind.split("e")[0]) or 8)
        n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        total += n * bits // 8
    return total


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per device of the collective ops in optimised HLO text, by kind.

    Each op counts the larger of its operands and its results: the whole buffer a device
    sends or receives (all-gather: the gathered result; reduce-scatter: the input;
    all-reduce, collective-permute, all-to-all: the buffer). An async ``-start`` returns a
    tuple of its operands and results: the results are that tuple less the operands. An
    op inside a loop body is counted once (a static count, like :func:`collectives`).
    """
    found: Counter = Counter()
    for line, m in _collective_lines(hlo_text):
        op = m.group(1)
        base = op.removesuffix("-start")
        result = _array_bytes(line[line.index("=") + 1 : m.start(1)])
        rest = line[m.end(1) :]
        args = rest[: rest.find(")")] if ")" in rest else rest
        operands = _array_bytes(args)
        if op.endswith("-start") and result > operands:
            result -= operands
        found[base] += max(result, operands)
    return dict(sorted(found.items()))


def _cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 -- a backend without cost analysis: no figure
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def model_flops_per_chip(trainer, chips: int) -> float:
    """The step's model FLOPs (docs/math.md, "Step FLOPs") per chip, every query taken to
    see its layer's window, or the whole row on full-attention layers: an upper bound."""
    from dspark_jax.train import throughput

    args, cfg = trainer.args, trainer.cfg
    rows, seq = trainer.rows_per_step, args.total_seq_len
    q = args.max_anchors * cfg.block_size
    context = [
        float(rows * q * min(cfg.layer_sliding_window(layer) or seq, seq))
        for layer in range(cfg.num_hidden_layers)
    ]
    total = throughput.train_step_flops(
        cfg, rows=rows, num_anchors=args.max_anchors, seq_len=seq, context=context,
        remat=bool(args.gradient_checkpointing), hardware=True,
    )  # fmt: skip
    return total / chips


def abstract_inputs(trainer, mesh):
    """ShapeDtypeStructs (with shardings) of the trainer's step inputs."""
    args, cfg = trainer.args, trainer.cfg
    graphdef, abstract = trainer.abstract_state()
    param_sh = parallel.state_shardings(abstract, mesh)
    total = args.max_steps or args.scheduler_total_steps or 1  # a constant of the schedule
    trainer.tx, trainer.schedules = optim.build_optimizer_from_flags(abstract, args.values, total)
    opt_abstract = jax.eval_shape(trainer.tx.init, abstract)
    opt_sh = parallel.state_shardings(opt_abstract, mesh)
    state_sh = {"params": param_sh, "opt": opt_sh}
    dt = frozen_dtype(args.verifier_name_or_path)
    h, vt, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    shapes = FrozenWeights((vt, h), (h, vd), (h, vd), (cfg.verifier_hidden_size,))
    frozen_sh = parallel.frozen_shardings(
        FrozenWeights(*(jax.ShapeDtypeStruct(s, dt) for s in shapes)), mesh
    )
    frozen = FrozenWeights(*(_shaped(s, dt, sh) for s, sh in zip(shapes, frozen_sh, strict=True)))

    def with_sh(tree, shardings):
        return jax.tree.map(lambda a, s: _shaped(a.shape, a.dtype, s), tree, shardings)

    state = {"params": with_sh(abstract, param_sh), "opt": with_sh(opt_abstract, opt_sh)}
    verifier = getattr(trainer, "instep", None)
    if verifier is not None:  # --hidden-states-backend jax: its weights are step inputs too
        vparams = verifier.abstract(mesh)
        frozen_sh = (frozen_sh, {n: a.sharding for n, a in vparams.items()})
        frozen = (frozen, vparams)
    r, s = trainer.rows_per_step, args.total_seq_len
    ht = cfg.verifier_hidden_size if verifier is None else 0  # tokens-only rows
    hs = jnp.bfloat16 if args.hidden_states_dtype == "bfloat16" else jnp.float32
    batch_shapes = {  # dspark_jax/data/pipeline.py's batch layout
        "hidden_states": ((r, s, cfg.num_aux_layers * ht), hs),
        "verifier_last_hidden_states": ((r, s, ht), hs),
        "input_ids": ((r, s), jnp.int32),
        "loss_mask": ((r, s), jnp.int32),
        "position_ids": ((r, s), jnp.int32),
        "document_ids": ((r, s), jnp.int32),
        "error_records": ((r,), jnp.int32),
    }
    batch = {
        k: _shaped(shape, dtype, parallel.batch_sharding(mesh, len(shape)))
        for k, (shape, dtype) in batch_shapes.items()
    }
    scalar = _shaped((), jnp.int32, NamedSharding(mesh, P()))
    return graphdef, state_sh, frozen_sh, state, frozen, batch, scalar


def _compile(name: str, jitted, *inputs) -> tuple[StepMemory, Any]:
    try:
        compiled = jitted.lower(*inputs).compile()
    except Exception as e:  # noqa: BLE001 -- only the compiler's out-of-memory is a result
        if not any(k in str(e) for k in _OOM):
            raise
        from dspark_jax.cli import one_line

        return StepMemory(name, error=one_line(e)), None
    m = compiled.memory_analysis()
    mem = StepMemory(
        name,
        arguments=m.argument_size_in_bytes,
        temporaries=m.temp_size_in_bytes,
        outputs=m.output_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        code=m.generated_code_size_in_bytes,
    )
    hlo = compiled.as_text()
    mem.collectives, mem.collective_bytes = collectives(hlo), collective_bytes(hlo)
    mem.flops = _cost_flops(compiled)
    return mem, compiled


def compile_steps(trainer) -> CompiledSteps:
    """Lower and compile the trainer's train and eval steps for ``--compile-for``."""
    target = compile_target.resolve(trainer.args.compile_for)
    mesh = trainer.mesh
    graphdef, state_sh, frozen_sh, state, frozen, batch, scalar = abstract_inputs(trainer, mesh)
    trainer._compile(graphdef, state_sh, frozen_sh)
    train, train_c = _compile("train", trainer.train_step, state, frozen, batch, scalar)
    ev, eval_c = _compile("eval", trainer.eval_step, state["params"], frozen, batch, scalar, scalar)
    heads = frozen if getattr(trainer, "instep", None) is None else frozen[0]
    head = _bytes_per_device(heads.verifier_lm_head)  # the trainer passes one buffer twice
    opt_bytes = sum(_bytes_per_device(x) for x in jax.tree.leaves(state["opt"]))
    for step in (train, ev):
        step.shared = head if step.error is None else 0
    ev.resident = opt_bytes if ev.error is None else 0
    return CompiledSteps(
        target, mesh, trainer.rows_per_step, train, ev, state_sh, frozen_sh, train_c, eval_c
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def report_lines(c: CompiledSteps, args) -> list[str]:
    t = c.target
    mesh = dict(c.mesh.shape)
    chips = f"{len(t.devices)} devices" + (
        f" on {t.chips} chips" if t.chips != len(t.devices) else ""
    )
    lines = [
        (
            f"compiled for {t.spec} ({chips}, {t.devices[0].device_kind}): mesh {mesh}, "
            f"{c.rows_per_step} rows of {args.total_seq_len} tokens per step "
            f"({c.rows_per_step / t.chips:g} per chip), --loss-chunk-tokens "
            f"{args.loss_chunk_tokens}, gradient checkpointing "
            f"{'on' if args.gradient_checkpointing else 'off'}"
        )
    ]
    limit = t.memory_per_device
    for s in (c.train, c.eval):
        if s.error is not None:
            lines.append(f"{s.name} step: does not fit: the compiler ran out of memory: {s.error}")
            continue
        extra = []
        if s.aliased:
            extra.append(f"- donated {_gib(s.aliased)}")
        if s.shared:
            extra.append(f"- shared head {_gib(s.shared)}")
        if s.resident:
            extra.append(f"+ optimizer state held {_gib(s.resident)}")
        verdict = "fits" if s.total <= limit else "does not fit"
        lines.append(
            f"{s.name} step per chip: arguments {_gib(s.arguments)}, temporaries "
            f"{_gib(s.temporaries)}, {' '.join([f'outputs {_gib(s.outputs)}', *extra])}; total "
            f"{_gib(s.total)} of {_gib(limit)} ({t.memory_source}): {verdict}"
        )
        coll = (
            ", ".join(
                f"{k} {v} ({_gib(s.collective_bytes.get(k, 0))})" for k, v in s.collectives.items()
            )
            or "none"
        )
        moved = sum(s.collective_bytes.values())
        flops = "n/a" if s.flops is None else f"{s.flops / 1e12:.4g} TFLOP"
        lines.append(
            f"{s.name} step collectives per chip: {coll}; {_gib(moved)} in all (ops in loop "
            f"bodies once); XLA's FLOPs per chip {flops}"
        )
    lines.append(
        f"{'fits' if c.fits else 'does not fit'}: {t.spec} with --mesh "
        f"{','.join(f'{k}={v}' for k, v in mesh.items())} and --rows-per-step {c.rows_per_step}"
    )
    return lines


def instep_line(trainer, steps: CompiledSteps) -> str:
    """--hidden-states-backend jax: the verifier's share of the step (weights per chip,
    forward FLOPs against the drafter's) and the storage it replaces."""
    from dspark_jax.train import throughput

    v, args, cfg = trainer.instep, trainer.args, trainer.cfg
    shards = steps.frozen_shardings[1]
    weights = sum(
        _bytes_per_device(jax.ShapeDtypeStruct(s.shape, v.param_dtype, sharding=shards[n]))
        for n, s in param_specs(v.cfg).items()
    )
    rows, seq = trainer.rows_per_step, args.total_seq_len
    fwd = v.forward_flops(rows, seq)
    opd = ""
    if args.training_stage == "opd":  # the verifier again, on the drafted blocks
        fwd += v.drafted_flops(rows, seq, args.max_anchors, cfg.block_size)
        opd = " and on the drafted blocks (Draft-OPD)"
    q = args.max_anchors * cfg.block_size
    drafter = throughput.train_step_flops(
        cfg, rows=rows, num_anchors=args.max_anchors, seq_len=seq,
        context=[float(rows * q * seq)] * cfg.num_hidden_layers,
    )  # fmt: skip
    slots = len(v.captured)
    per_token = slots * v.cfg.hidden_size * np.dtype(v.out_dtype).itemsize
    return (
        f"in-step verifier ({v.cfg.model_type}, {v.cfg.num_hidden_layers} layers, "
        f"{np.dtype(v.param_dtype).name} weights {_gib(weights)} per chip): forward{opd} <= "
        f"{fwd / 1e12:.3g} TFLOP per step vs the drafter step's <= {drafter / 1e12:.3g} TFLOP "
        f"({fwd / (fwd + drafter):.0%} of the step); no hidden-state files: "
        f"{per_token * seq / 2**20:.3g} MiB per {seq}-token sample not stored"
    )


def compile_report(trainer) -> int:
    """Print the report; 0 if both steps fit, 1 if not."""
    steps = compile_steps(trainer)
    lines = report_lines(steps, trainer.args)
    if steps.train.error is None:
        model = model_flops_per_chip(trainer, steps.target.chips)
        lines.insert(
            -1,
            f'train step model FLOPs per chip {model / 1e12:.4g} TFLOP (docs/math.md, "Step '
            'FLOPs"; every query sees its whole window or row: an upper bound)',
        )
    if getattr(trainer, "instep", None) is not None:
        lines.insert(-1, instep_line(trainer, steps))
    for line in lines:
        print(f"[compile] {line}", flush=True)
    return 0 if steps.fits else 1
