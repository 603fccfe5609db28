"""Sparse MLA attention decode at GLM-5 shapes next to the reference, dense MLA and the tile's peak.

    python benchmarks/bench_mla.py [--quick] [--json FILE] [--contention N] [--threads N] [--best-of N]
                                   [--threads-check]
"""

import argparse
from pathlib import Path

import numba
import torch

from sparsekv.bench import mla
from sparsekv.bench.common import busy_processes, format_table, rows_to_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="run with N busy processes competing for the CPUs (stopped at the end)")
    parser.add_argument("--threads", type=int, help="torch and numba threads (default: as configured)")
    parser.add_argument("--best-of", type=int, default=0, metavar="N",
                        help="the fastest of N back-to-back calls of ours, the reference and the peak peer")
    parser.add_argument("--threads-check", action="store_true",
                        help="ours and the 1thread peer only, 120 rounds: the check that threads never hurt")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    with busy_processes(args.contention) as load:
        rows = mla.run(quick=args.quick, best_of=args.best_of, check_threads=args.threads_check)
    print(format_table(rows, load))
    if args.json:
        args.json.write_text(rows_to_json(rows, load))
