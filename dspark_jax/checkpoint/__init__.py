"""Checkpoints and drafters on disk, below train, eval and convert.

* ``orbax_io``: the Orbax checkpoint format (the one owner of it): params-only and
  training checkpoints, their ``meta``, vocab maps beside the steps, restores that
  fail in one line.
* ``checkpointer``: the trainer's asynchronous saves, retention and resume (only the
  trainer imports it).
* ``load``: the one drafter loader (an Orbax checkpoint or a speculators folder).

Nothing is imported here, so that importing one module stays cheap.
"""
