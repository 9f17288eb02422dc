"""Checkpoints and drafters on disk, below train, eval and convert.

* ``orbax_io``: the Orbax checkpoint format (the one owner of it): params-only and
  training checkpoints, their ``meta``, retention, vocab maps beside the steps.
* ``load``: the one drafter loader (an Orbax checkpoint or a speculators folder).

Nothing is imported here, so that importing one module stays cheap.
"""
