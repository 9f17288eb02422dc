"""One of two trainer processes whose rows' tokens are split over both (tests/train/
test_multiprocess.py starts them with tests.multiprocess.launch).

    python -m tests.train.context_child <trainer flags with --mesh context=4 ...>

Each process has 2 CPU devices; ``--mesh context=4`` puts each row's tokens on all 4, so
process 0 holds tokens [0, S/2) and process 1 [S/2, S). Before training it checks that
a mesh whose device order interleaves the processes along ``context`` is refused, and
that make_mesh reorders such devices into one token range per process; while
training, that every batch this process builds holds the hidden states of its half of
each row only (token ids and masks whole). Prints ``held LO:HI of S`` and trains.
"""

import sys

import jax
import numpy as np

from dspark_jax import parallel
from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train


def main() -> int:
    train.setup_logging()
    args = cli.resolve(sys.argv[1:])
    parallel.initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    seq = args.total_seq_len
    # Interleaved: process 0 would hold tokens 0:16 and 32:48 of a row, no one range.
    devices = sorted(jax.devices(), key=lambda d: (d.id % 2, d.process_index))
    interleaved = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 4, 1), parallel.MESH_AXES)
    try:
        parallel.check_context_split(interleaved, seq)
    except ValueError as e:
        assert "not the same token range of each of its rows" in str(e), e
    else:
        raise AssertionError("an interleaved context group was accepted")
    # make_mesh orders each context group by process: one token range per process again
    mesh = parallel.make_mesh("context=4", devices)
    parallel.check_context_split(mesh, seq)
    assert parallel.process_rows(mesh, 1, seq)[1] == (
        jax.process_index() * seq // 2,
        (jax.process_index() + 1) * seq // 2,
    )

    held = set()
    real = parallel.global_batch

    def checked(local, mesh, rows=None):
        # every row of the step (context=4 is the whole mesh), half of each row's tokens
        n, half = args.rows_per_step, seq // 2
        assert local["input_ids"].shape == (n, seq), local["input_ids"].shape
        for key in ("hidden_states", "verifier_last_hidden_states"):
            assert local[key].shape[:2] == (n, half), (key, local[key].shape)
        _, tokens = parallel.process_rows(mesh, rows, seq)
        held.add(tokens)
        return real(local, mesh, rows)

    parallel.global_batch = checked
    code = train.run(args)
    assert held == {(jax.process_index() * seq // 2, (jax.process_index() + 1) * seq // 2)}, held
    print(f"held {min(held)[0]}:{min(held)[1]} of {seq}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
