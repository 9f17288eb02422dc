"""Shared test setup: 8 simulated CPU devices (set before JAX is imported), and the
rules that keep a broken install from passing with fewer tests.

* A test marked ``reference`` (it needs speculators / hs_connectors, the
  ``reference`` extra) is skipped, not errored, where those are not installed.
* Under ``CI=true`` (.ci/run exports it) such a skip fails the run instead, and so
  does a skipped ``mooncake`` test (a real Mooncake store) where libibverbs.so.1 is
  installed or the Mooncake wheel itself is missing, a skipped ``tpu`` test (it
  compiles for a TPU topology: libtpu, the ``tpu`` extra), a skipped ``cuda_compile``
  test (compiles for GPUs: the ``cuda-compile`` extra), a skipped ``vllm`` test
  (vLLM 0.33.0 itself, in the separate environment named by ``DSPARK_VLLM_PYTHON``),
  a skipped ``served`` test (llama.cpp's server, built from the pinned sdist and named
  by ``DSPARK_LLAMA_SERVER``), a skipped ``sglang_jax`` test (the vendored sglang-jax
  subset in third_party/sglang_jax and its venv, named by ``DSPARK_SGLANG_JAX_SRC`` and
  ``DSPARK_SGLANG_JAX_PYTHON``),
  a skip for a machine CI is sized for (fewer than 8 simulated devices, ``srun`` on
  PATH) or for a tracker the ``loggers`` extra installs (:data:`CI_NEVER_SKIPS`),
  and a test module skipped whole: CI installs every extra, so a skip there means a
  broken install.
* A skip for want of speculators / hs_connectors in a test *not* marked
  ``reference`` fails under CI=true and in the blocked run (tests/block_reference/),
  as does a module that skips for them without being marked ``reference`` whole:
  the marker is on every test that needs the reference packages.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

_DEVICES = "--xla_force_host_platform_device_count"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):  # add to the user's flags, keep theirs
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}=8".strip()
# The suite compiles hundreds of tiny programs: LLVM's optimisation passes are most of
# XLA:CPU's compile time there and buy nothing at these shapes (test_scan.py: 46 s
# instead of 65 s, back to back on 2 cores). The arithmetic is unchanged: without
# fast-math (XLA:CPU's default) LLVM may not reorder or contract floating-point
# operations at any level. Subprocesses inherit it.
_OPT = "--xla_backend_optimization_level"
if _OPT not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" {_OPT}=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The Mooncake client library (mooncake.store) sets glog's minloglevel from MC_LOG_LEVEL
# when it loads (so before any test imports it; GLOG_minloglevel is overridden by it):
# errors only, or its INFO lines flood the output of the real-store tests.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

REFERENCE_PACKAGES = ("speculators", "hs_connectors")
# Skip reasons that mean a broken CI machine or install, not an optional feature.
CI_NEVER_SKIPS = (
    "needs 8 (simulated) devices",  # XLA_FLAGS above: only an overriding flag skips
    "this machine has srun",  # the Slurm recipe's no-srun path must run somewhere: CI
    "could not import 'wandb'",  # the loggers extra
    "could not import 'trackio'",
    "could not import 'mlflow'",
)
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

# Session fixtures of more than one test directory (loaded after the environment above).
pytest_plugins = ("tests.verifier.instep_fixtures", "tests.served.fixtures")


def _blocked() -> bool:
    """The run deliberately without the reference packages (-p tests.block_reference)."""
    return os.environ.get("DSPARK_REFERENCE_BLOCKED") == "1"


@functools.cache
def _reference_missing() -> str | None:
    """Why the reference packages are missing (found, not imported: one that is
    installed but broken fails its tests)."""
    for name in REFERENCE_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError as e:  # tests/block_reference
            found, why = False, str(e)
        else:
            why = f"No module named {name!r}"
        if not found:
            return f"needs the reference extra (pip install -e '.[reference]'): {why}"
    return None


@functools.cache
def _has_libibverbs() -> bool:
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=False)
        except OSError:
            continue
        return "libibverbs.so.1" in out.stdout
    return False


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("reference") and (why := _reference_missing()):
        pytest.skip(why)


def _names_reference_package(reason: str) -> bool:
    return any(name in reason for name in REFERENCE_PACKAGES)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _item_skip_is_failure(item: pytest.Item, reason: str) -> str | None:
    blocked = _blocked()
    if item.get_closest_marker("reference"):
        if CI and not blocked:
            return "a test marked 'reference' was skipped under CI=true (broken reference extra?)"
        return None
    if (CI or blocked) and _names_reference_package(reason):
        return "this test needs speculators/hs_connectors: mark it @pytest.mark.reference"
    if CI and any(never in reason for never in CI_NEVER_SKIPS):
        return "this skip means a broken CI machine or install (tests/conftest.py CI_NEVER_SKIPS)"
    if CI and item.get_closest_marker("tpu"):
        return "a test marked 'tpu' was skipped under CI=true (libtpu, the tpu extra, missing?)"
    if CI and item.get_closest_marker("cuda_compile"):
        return "a test marked 'cuda_compile' was skipped under CI=true (the cuda-compile extra missing?)"
    if CI and item.get_closest_marker("vllm"):
        return (
            "a test marked 'vllm' was skipped under CI=true (.ci/run installs vLLM 0.33.0 "
            "in its own venv and sets DSPARK_VLLM_PYTHON)"
        )
    if CI and item.get_closest_marker("served"):
        return (
            "a test marked 'served' was skipped under CI=true (.ci/run builds llama-server "
            "and names it in DSPARK_LLAMA_SERVER)"
        )
    if CI and item.get_closest_marker("sglang_jax"):
        return (
            "a test marked 'sglang_jax' was skipped under CI=true (.ci/run builds its venv "
            "with launch/engines/build_sglang_jax_venv.sh and sets DSPARK_SGLANG_JAX_PYTHON "
            "and DSPARK_SGLANG_JAX_SRC)"
        )
    if CI and item.get_closest_marker("mooncake"):
        # the wheel (dev extra) always installs; only its system library may be missing
        if "No module named 'mooncake" in reason:
            return (
                "a real-Mooncake test was skipped under CI=true: the dev extra's wheel is missing"
            )
        if _has_libibverbs():
            return (
                "a real-Mooncake test was skipped under CI=true though libibverbs.so.1 is installed"
            )
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if why := _item_skip_is_failure(item, reason):
            report.outcome = "failed"
            report.longrepr = f"{why}\nskip reason: {reason}"
    return report


def _module_marked_reference(path: Path) -> bool:
    """Whether the module sets ``pytestmark`` to (a list holding) the reference mark."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return "mark.reference" in ast.unparse(node.value)
    return False


def _module_skip_is_failure(module: pytest.Module, reason: str) -> str | None:
    if _blocked():
        if _names_reference_package(reason) and not _module_marked_reference(module.path):
            return (
                "this module skips without speculators/hs_connectors but is not marked "
                "'reference' as a whole: import them in the tests that need them"
            )
        return None
    if CI:  # CI installs every extra: no module may skip whole
        return "a whole test module was skipped under CI=true (broken install?)"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.skipped and isinstance(collector, pytest.Module):
        reason = _skip_reason(report)
        if why := _module_skip_is_failure(collector, reason):
            report.outcome = "failed"
            report.longrepr = f"{collector.nodeid}: {why}\nskip reason: {reason}"
    return report
