"""Training: ``python -m dspark_jax.train``.

* ``flags``: the reference trainer's flags (plus the JAX ones), YAML configs, ``run.yaml``.
* ``drafter_setup``: which drafter the run trains (fresh from the verifier, a
  ``--draft-config``, or ``--from-pretrained``) and its vocab maps.
* ``trainer``: the loop: sharded jit step, validation, checkpoints, resume, signals.
* ``dry_run``: ``--dry-run``: initialise, save, and report what the run needs.
* ``metrics_log``: the reference's metric names, the JSONL/TensorBoard log, progress lines.

Checkpoints (the Orbax format) and the drafter loader live below, in
:mod:`dspark_jax.checkpoint`.

Nothing is imported here, so that importing one module stays cheap.
"""
