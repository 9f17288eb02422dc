"""Start a local ``mooncake_master`` on free ports: a one-node online run, the tests and
bench/ (the cluster recipes start theirs in launch/recipes/common.sh)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(log_path: Path, timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """(the master process, its ``host:port``); the binary ships in the mooncake wheel."""
    import mooncake

    binary = shutil.which("mooncake_master") or str(
        Path(mooncake.__file__).parent / "mooncake_master"
    )
    port, metrics = free_port(), free_port()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [binary, "--rpc_port", str(port), "--metrics_port", str(metrics),
             "--rpc_thread_num", "2", "--enable_disk_eviction=false", "--logtostderr=true"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"mooncake_master did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.1)
