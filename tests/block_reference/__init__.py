"""pytest plugin: ``python -m pytest -p tests.block_reference ...`` runs the tests with
``speculators`` and ``hs_connectors`` unimportable, in this process and in its Python
children (this folder goes first on PYTHONPATH, so they import sitecustomize.py from
it), as on an install without the ``reference`` extra.

.ci/run uses it with ``-m "not reference"`` to prove that no unmarked test needs them;
tests/conftest.py fails a test or module that skips for want of them without being
marked ``reference``."""

from __future__ import annotations

import os
from pathlib import Path

from tests.block_reference import sitecustomize

_HERE = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p
)
sitecustomize.install()
