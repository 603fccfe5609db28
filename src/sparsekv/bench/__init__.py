"""Benchmark cases (one module per op family) and the shared timing/table code.

Each family module exposes ``run(quick: bool = False) -> list[BenchRow]``; the
scripts in ``benchmarks/`` and ``sparsekv bench`` call them.
"""

from .common import BenchRow, copy_peer, format_table, time_call

__all__ = ["BenchRow", "copy_peer", "format_table", "time_call"]
