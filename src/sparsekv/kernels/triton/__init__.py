"""Kernel backends; see sparsekv.ops._registry for how one is chosen."""
