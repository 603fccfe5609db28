"""Paged store/load throughput (GB/s) next to a same-run torch copy of the same bytes.

    python benchmarks/bench_cache.py [--quick] [--json FILE] [--contention N]
"""

import argparse
from pathlib import Path

from sparsekv.bench import cache
from sparsekv.bench.common import busy_processes, format_table, rows_to_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny shape")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="run with N busy processes competing for the CPUs (stopped at the end)")
    args = parser.parse_args()
    with busy_processes(args.contention) as load:
        rows = cache.run(quick=args.quick)
    print(format_table(rows, load))
    if args.json:
        args.json.write_text(rows_to_json(rows, load))
