"""Modes of the files and folders we create: what ``open()``/``mkdir()`` give under the
process umask.

safetensors' ``save_file`` creates its file 0600 and ``tempfile.mkdtemp`` its folder
0700, so a drafter or hidden states written to shared storage could not be read by
another user; writers pass what they create through :func:`share`. No JAX here:
launch/ imports this module too.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it where Linux allows (threads write too)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open()`` (file) or ``mkdir()`` (folder) would."""
    full = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, full & ~umask())
