"""Paged store/load throughput (GB/s) next to a same-run torch copy of the same bytes.

    python benchmarks/bench_cache.py [--quick] [--json FILE]
"""

import argparse
from pathlib import Path

from sparsekv.bench import cache
from sparsekv.bench.common import format_table, rows_to_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny shape")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    rows = cache.run(quick=args.quick)
    print(format_table(rows))
    if args.json:
        args.json.write_text(rows_to_json(rows))
