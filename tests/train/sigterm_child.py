"""Run the trainer in a subprocess and SIGTERM it after a given step (tests/train).

    python tests/train/sigterm_child.py KILL_AT_STEP NUM_DEVICES <trainer flags...>

KILL_AT_STEP < 0: no signal. The signal is sent by the process to itself from the
trainer's step callback, so the step it lands after is deterministic. The run uses
the first NUM_DEVICES devices (the parent test process has 8 simulated ones; the
child gets the same XLA flags so that it finds the parent's compilations in the
persistent cache).
"""

import os
import signal
import sys

from dspark_jax.train import flags as cli
from dspark_jax.train import trainer as train


def main() -> int:
    import jax

    train.setup_logging()
    kill_at, num_devices = int(sys.argv[1]), int(sys.argv[2])

    def callback(trainer):
        if trainer.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGTERM)

    args = cli.resolve(sys.argv[3:])
    return train.run(args, devices=jax.devices()[:num_devices], step_callback=callback)


if __name__ == "__main__":
    sys.exit(main())
