"""Engine adapters: run other libraries' models through sparsekv's caches and kernels.

Each adapter is an optional extra, imported explicitly; importing ``sparsekv``
or this package never imports the engine:

* :mod:`sparsekv.integrations.transformers` (``pip install -e ".[hf]"``):
  ``patch_model`` / ``unpatch_model`` for Hugging Face transformers models.
"""
