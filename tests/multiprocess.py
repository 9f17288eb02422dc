"""Runs of a module in fresh Python processes on CPU devices: one process, or several on
localhost joined by jax.distributed (each module takes the trainer's
``--coordinator-address --num-processes --process-id`` flags)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import portpicker

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def cpu_env(devices: int) -> dict[str, str]:
    """This environment with ``devices`` CPU devices per process and the repository first
    on the import path."""
    env = dict(os.environ)
    # the suite's other flags (tests/conftest.py) kept, the device count replaced
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


class Launched:
    """``python -m module *argv`` running in ``processes`` processes of ``devices`` CPU
    devices each (:func:`start`); :meth:`wait` for their stdouts."""

    def __init__(self, module: str, argv: list[str], devices: int, processes: int):
        cmds = [[PYTHON, "-m", module, *argv]]
        if processes > 1:
            address = f"127.0.0.1:{portpicker.pick_unused_port()}"
            distributed = ["--coordinator-address", address, "--num-processes", str(processes)]
            cmds = [[*cmds[0], *distributed, "--process-id", str(i)] for i in range(processes)]
        self.module, self.started = module, time.monotonic()
        # Files, not pipes: no process blocks on a full pipe read only after another exits.
        self.files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in cmds]
        env = cpu_env(devices)
        self.procs = [
            subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
            for cmd, (out, err) in zip(cmds, self.files, strict=True)
        ]
        self.ends: list[tuple[int, str, str, str]] | None = None

    def wait(self, timeout: float = 600) -> list[str]:
        """Asserts that every process exits 0 within ``timeout`` s of the start; returns
        their stdouts, in process order. A process that fails (or the timeout) ends the
        others, which would wait for it in a collective; the failure names the process
        and shows the end of its stderr."""
        if self.ends is None:
            self.ends = self._end(timeout)
        # Those that ended on their own first: the others were killed waiting for them.
        for i, (code, why, _, err) in sorted(
            enumerate(self.ends), key=lambda e: e[1][1] != "exited"
        ):
            assert code == 0, (
                f"process {i} of {len(self.ends)} ({self.module}) {why}, code {code}:\n{err[-3000:]}"
            )
        return [out for _, _, out, _ in self.ends]

    def _end(self, timeout: float) -> list[tuple[int, str, str, str]]:
        """(exit code, how it ended, stdout, stderr) of each process."""
        procs, deadline, timed_out = self.procs, self.started + timeout, False
        try:
            while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
                if timed_out := time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            ended = [p.poll() is not None for p in procs]
            self.kill()
        killed = "killed: " + ("timeout" if timed_out else "a peer failed")
        ends = []
        for p, done, (out, err) in zip(procs, ended, self.files, strict=True):
            out.seek(0)
            err.seek(0)
            ends.append((p.returncode, "exited" if done else killed, out.read(), err.read()))
            out.close()
            err.close()
        return ends

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def start(module: str, argv: list[str], *, devices: int, processes: int) -> Launched:
    """Start ``python -m module *argv`` in ``processes`` processes of ``devices`` CPU
    devices each. One process: a plain run. More: process i gets ``--coordinator-address
    127.0.0.1:<free port> --num-processes N --process-id i``."""
    return Launched(module, argv, devices, processes)


def launch(
    module: str, argv: list[str], *, devices: int, processes: int, timeout: float = 600
) -> list[str]:
    """:func:`start`, then :meth:`Launched.wait`: the processes' stdouts, all exited 0."""
    return start(module, argv, devices=devices, processes=processes).wait(timeout)
