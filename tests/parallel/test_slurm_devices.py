"""One trainer process per Slurm node drives every GPU of the node."""

from __future__ import annotations

import pytest

from dspark_jax.parallel import slurm_local_device_ids


@pytest.mark.parametrize(
    ("env", "ids"),
    [
        ({"SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, [0, 1, 2, 3]),
        ({"SLURM_TASKS_PER_NODE": "1(x2)", "CUDA_VISIBLE_DEVICES": "4,5"}, [0, 1]),
        ({"SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "8"}, list(range(8))),
        # one task per GPU: JAX's own default (device SLURM_LOCALID) is right
        ({"SLURM_TASKS_PER_NODE": "4(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, None),
        ({"SLURM_TASKS_PER_NODE": "1,4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, None),
        # one GPU or none (CPU nodes): nothing to choose
        ({"SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0"}, None),
        ({"SLURM_NTASKS_PER_NODE": "1"}, None),
        # the user's explicit choice wins
        (
            {
                "SLURM_NTASKS_PER_NODE": "1",
                "CUDA_VISIBLE_DEVICES": "0,1",
                "JAX_LOCAL_DEVICE_IDS": "0",
            },
            None,
        ),
    ],
)
def test_slurm_local_device_ids(env, ids):
    assert slurm_local_device_ids(env) == ids
