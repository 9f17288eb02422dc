"""Training data: what the PyTorch/vLLM side writes, read, validated, packed.

* ``files``: prepared Arrow rows, safetensors and ``hs_{i}.safetensors`` readers.
* ``packing``: per-epoch plan of documents into rows of S tokens over all ranks.
* ``pipeline``: the Grain pipeline (``PackedData``, ``make_train_iterator``).

Nothing is imported here, so that importing one module stays cheap.
"""
