"""The speculators drafter folder (``config.json`` + ``model.safetensors``) that vLLM
serves: writing it from params (``export``), reading it back (``importer``), and the
checks that vLLM 0.33 and speculators 0.9.0 would load it as trained (``check``).

The ``python -m converters`` CLI sits on top of these; the trainer uses them for
``--dry-run``. Reading a folder into a drafter (for the import, ``--from-pretrained``
and eval alike) is :mod:`dspark_jax.checkpoint.load`, below this package.
"""
