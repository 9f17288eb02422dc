"""Make ``speculators`` and ``hs_connectors`` unimportable, as on an install without
the ``reference`` extra. Imported by the pytest plugin (tests/block_reference) and, as
``sitecustomize`` through PYTHONPATH, by every Python child process of the run."""

from __future__ import annotations

import importlib.abc
import os
import sys

BLOCKED = ("speculators", "hs_connectors")
ENV = "DSPARK_REFERENCE_BLOCKED"  # tests/conftest.py reads it


class BlockReference(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked by tests/block_reference)", name=name
            )


def install() -> None:
    if not any(isinstance(f, BlockReference) for f in sys.meta_path):
        for name in [m for m in sys.modules if m.partition(".")[0] in BLOCKED]:
            del sys.modules[name]
        sys.meta_path.insert(0, BlockReference())
    os.environ[ENV] = "1"


install()
