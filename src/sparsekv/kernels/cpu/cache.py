"""CPU paged store.

A store is a scatter of whole ``[H, D]`` rows; one vectorised ``index_put``
already runs at memory speed on the CPU (see ``benchmarks/bench_cache.py``),
so the CPU path is the reference itself.
"""

from ..reference.cache import paged_store

__all__ = ["paged_store"]
