"""Public ops: argument checks, then dispatch to a backend (see ``_registry``)."""

from .mla import mla_sparse_attention_paged  # noqa: F401
