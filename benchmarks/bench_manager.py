"""Paged KV cache manager overhead per scheduler step (us per request), next to a dict-of-lists page table.

    python benchmarks/bench_manager.py [--quick] [--json FILE]
"""

import argparse
from pathlib import Path

from sparsekv.bench import manager
from sparsekv.bench.common import format_table, rows_to_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small batch")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    rows = manager.run(quick=args.quick)
    print(format_table(rows))
    for row in rows:
        print(f"{row.op:24s} {row.shape:32s} {row.note}")
    if args.json:
        args.json.write_text(rows_to_json(rows))
