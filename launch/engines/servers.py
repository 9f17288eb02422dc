"""Real engines on loopback, for the served-acceptance bench and the served tests:
llama.cpp's ``llama-server`` and vLLM's CPU build, started, asked for greedy completions
of token-id prompts, their speculative-decoding counters read from ``/metrics``, stopped.

Counters (docs/engines.md): llama.cpp adds a request's counters to ``/metrics`` when its
slot is released (``llamacpp:spec_decode_num_drafts_total`` ...), vLLM per engine step
(``vllm:spec_decode_num_drafts_total`` ..., summed over its ``engine`` labels); both count
steps with a non-empty draft, drafted and accepted tokens (the bonus not counted), and the
drafts accepted through each position.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREFIX = {"llama.cpp": "llamacpp:", "vllm": "vllm:"}
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


class EngineError(RuntimeError):
    """The engine did not start or answer (the message names it and its log)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def spec_counts(text: str, engine: str) -> dict:
    """The speculative-decoding counters in a ``/metrics`` text (summed over labels but
    ``position``): ``{"drafts", "draft_tokens", "accepted": int, "accepted_per_pos": [int]}``."""
    from prometheus_client.parser import text_string_to_metric_families

    prefix = PREFIX[engine] + "spec_decode_num_"
    totals = dict.fromkeys(COUNTERS, 0.0)
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not (s.name.startswith(prefix) and s.name.endswith("_total")):
                continue  # other metrics, and the counters' _created timestamps
            name = s.name[len(prefix) : -len("_total")]
            if name in totals:
                totals[name] += s.value
            elif name == "accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    n = max(per_pos) + 1 if per_pos else 0
    return {
        "drafts": round(totals["drafts"]),
        "draft_tokens": round(totals["draft_tokens"]),
        "accepted": round(totals["accepted_tokens"]),
        "accepted_per_pos": [round(per_pos.get(i, 0.0)) for i in range(n)],
    }


def difference(before: dict, after: dict) -> dict:
    """The counters of what ran between two :func:`spec_counts`."""
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    n = max(len(before["accepted_per_pos"]), len(after["accepted_per_pos"]))
    pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
    out["accepted_per_pos"] = [
        a - b for a, b in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))
    ]
    return out


@dataclasses.dataclass
class Server:
    """A running engine: ``base`` URL, its process and log file."""

    engine: str
    base: str
    process: subprocess.Popen
    log: Path

    def metrics(self) -> dict:
        return spec_counts(http(f"{self.base}/metrics").decode(), self.engine)

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        """A greedy completion of token ids: ``{"tokens", "stop": "eos"|"length"}`` (the
        end-of-sequence token a response stopped on is not in ``tokens``)."""
        if self.engine == "llama.cpp":
            out = json.loads(http(f"{self.base}/completion", {
                "prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                "return_tokens": True, "cache_prompt": False,
            }))  # fmt: skip
            stop = "eos" if out.get("stop_type") == "eos" else "length"
            return {"tokens": list(out["tokens"]), "stop": stop, "timings": out.get("timings")}
        out = json.loads(http(f"{self.base}/v1/completions", {
            "model": self.model_name(), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True,
        }))  # fmt: skip
        choice = out["choices"][0]
        stop = "eos" if choice.get("finish_reason") == "stop" else "length"
        return {"tokens": list(choice["token_ids"]), "stop": stop}

    def model_name(self) -> str:
        if not hasattr(self, "_model"):
            self._model = json.loads(http(f"{self.base}/v1/models"))["data"][0]["id"]
        return self._model

    def settle(self, before: dict, drafted: bool, timeout: float = 10.0) -> dict:
        """The counters once the last request's are in (llama.cpp adds them when its slot
        is released, just after the response)."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.metrics()
            if not drafted or now["drafts"] != before["drafts"] or time.monotonic() > deadline:
                return now
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait(server: Server, timeout: float) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise EngineError(f"{server.engine} exited {server.process.returncode}: {tail}")
        try:
            http(f"{server.base}/health", timeout=5)
            return server
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    server.stop()
    raise EngineError(f"{server.engine} did not answer /health in {timeout:.0f} s ({server.log})")


def _launch(engine: str, cmd: list[str], port: int, log: str | Path, timeout: float) -> Server:
    """Start ``cmd`` (output to ``log``) and wait until it answers on ``port``."""
    log = Path(log)
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return _wait(Server(engine, f"http://127.0.0.1:{port}", proc, log), timeout)


def llama_server_binary() -> str:
    """``$DSPARK_LLAMA_SERVER``, else the pinned build (built on first use, ~11 min)."""
    if os.environ.get("DSPARK_LLAMA_SERVER"):
        return os.environ["DSPARK_LLAMA_SERVER"]
    out = subprocess.run(
        ["bash", str(HERE / "build_llama_server.sh")], check=True, capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[-1]


def start_llamacpp(
    verifier_gguf: str | Path,
    draft_gguf: str | Path | None,
    draft_tokens: int,
    log: str | Path,
    *,
    threads: int = 2,
    binary: str | None = None,
    extra: list[str] | None = None,
    timeout: float = 120.0,
) -> Server:
    """``llama-server`` greedy on loopback (``converters check --target llama.cpp``'s
    command), with ``draft_gguf`` as its DSpark drafter (None: no speculation)."""
    port = free_port()
    cmd = [binary or llama_server_binary(), "-m", str(verifier_gguf), "-np", "1", "--metrics",
           "--temp", "0", "--top-k", "1", "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads)]  # fmt: skip
    if draft_gguf is not None:
        cmd += ["-md", str(draft_gguf), "--spec-type", "draft-dspark",
                "--spec-draft-n-max", str(draft_tokens), "--spec-draft-p-min", "0"]  # fmt: skip
    return _launch("llama.cpp", cmd + (extra or []), port, log, timeout)


def start_vllm_cpu(
    verifier: str | Path,
    drafter: str | Path | None,
    draft_tokens: int,
    log: str | Path,
    *,
    timeout: float = 600.0,
) -> Server:
    """vLLM's CPU build (launch/engines/vllm_cpu_serve.sh), DSpark when ``drafter``."""
    port = free_port()
    cmd = ["bash", str(HERE / "vllm_cpu_serve.sh"), str(verifier), str(port)]
    if drafter is not None:
        spec = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": draft_tokens}
        cmd += ["--speculative-config", json.dumps(spec)]
    return _launch("vllm", cmd, port, log, timeout)
