"""Evaluation: ``python -m dspark_jax.eval``.

* ``slot_statistics``: per-slot acceptance values of a drafter on a packed row
  (JAX; teacher-forced and free-running, as vLLM drafts).
* ``acceptance``: acceptance curves and ``accept_len`` from per-slot values (numpy).
* ``calibration``: confidence-head calibration and temperature scaling (numpy).
* ``report``: tables, CSV, JSON and plots.
* ``runner``: loading the drafter, the datasets, the CLI.

Nothing is imported here, so that importing one module stays cheap.
"""
