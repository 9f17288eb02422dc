"""``python -m dspark_jax.train``."""

import sys

from dspark_jax.train.trainer import main

sys.exit(main())
