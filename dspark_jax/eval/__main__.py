"""``python -m dspark_jax.eval``."""

import sys

from dspark_jax.eval.runner import main

sys.exit(main())
