"""Restores a pipeline iterator from a saved state in a fresh process (test helper).

python -m tests.data.resume_child CONFIG.json: builds PackedData from the config,
``set_state`` from it, prints the digests of the next ``m`` batches as JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np


def digest(batch: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(np.ascontiguousarray(batch[k]).view(np.uint8).tobytes())
    return h.hexdigest()[:16]


def main(config_path: str) -> None:
    from dspark_jax.data.pipeline import PackedData

    cfg = json.loads(Path(config_path).read_text())
    data = PackedData(cfg["data_path"], **cfg["data"])
    it = data.train_iterator(**cfg["iterator"])
    it.set_state(cfg["state"])
    out = [digest(next(it)) for _ in range(cfg["m"])]
    it.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
