"""CPU sparse MLA attention (SPEC 3.4): the reference's PyTorch code, same signature."""

from __future__ import annotations

from ..reference.mla import mla_sparse_attention_paged

__all__ = ["mla_sparse_attention_paged"]
