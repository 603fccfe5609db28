"""Kernel backends; see sparsekv.ops._registry for how one is chosen."""

from . import _jit_cache  # noqa: F401  (keys numba's cache on every kernel source before a kernel is defined)
