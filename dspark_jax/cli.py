"""The guard around every command line (train, eval, converters, launch/): an exception
that escapes a command becomes one line, ``error: <message>``, and exit status 1.

A user's bad input (a truncated file, a full disk, a flag the machine cannot honour)
is answered by the message, which names the file or flag; the traceback helps only
a developer, so it is shown with ``--debug`` (before any ``--``) or ``DSPARK_DEBUG=1``.
No JAX here: launch/ imports this module too.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

DEBUG_FLAG = "--debug"
DEBUG_ENV = "DSPARK_DEBUG"
MAX_CHARS = 2000  # tensorstore appends kilobytes of spec to its messages
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (jax/_src/hardware_utils.py)
GPU_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


class ConfigError(ValueError):
    """A user-facing configuration error; the CLI prints it and exits with status 2."""


def debug_enabled(argv: Sequence[str] = ()) -> bool:
    """``--debug`` among this command's own flags, or ``DSPARK_DEBUG`` set (not 0)."""
    own = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    return DEBUG_FLAG in own or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (the type is named when the text is bare)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    text = text.split(" [tensorstore_spec=")[0]
    if not text or isinstance(error, (KeyError, AttributeError, TypeError, IndexError)):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


def reraise_if_debug() -> None:
    """In an ``except`` block that prints a command's own one-line error: with debugging
    on, let the exception (and its traceback) through instead."""
    if debug_enabled():
        raise  # the exception being handled by the caller


def google_pci_device() -> bool:
    """A Google device (a TPU chip, or a gVNIC) on the PCI bus: jax's own probe
    (``jax/_src/hardware_utils.py``), without importing JAX."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def _has_accelerator() -> bool:
    return google_pci_device() or any(os.path.exists(d) for d in GPU_DEVICE_NODES)


def cpu_only_without_accelerator() -> None:
    """``JAX_PLATFORMS=cpu`` on a machine without TPU or GPU, unless the user set it.

    With the ``tpu`` extra installed, JAX would otherwise try libtpu's backend first and
    print its failure to stderr (a few lines, every command); CPU is what it ends on.
    """
    if "JAX_PLATFORMS" not in os.environ and not _has_accelerator():
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax = sys.modules.get("jax")
        if jax is not None:  # imported already: it read the environment then
            jax.config.update("jax_platforms", "cpu")


def guarded(main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` (``--debug`` removed); an escaping exception -> one line, status 1.

    ``--debug`` sets ``DSPARK_DEBUG=1`` for the process, so that every part (Orbax's
    error logs, a command's own error lines) sees it. Ctrl-C exits 130 with one line,
    as shells report SIGINT.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(argv)
    if debug:
        os.environ[DEBUG_ENV] = "1"
    cut = argv.index("--") if "--" in argv else len(argv)
    argv = [a for a in argv[:cut] if a != DEBUG_FLAG] + argv[cut:]
    cpu_only_without_accelerator()
    try:
        return main(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
