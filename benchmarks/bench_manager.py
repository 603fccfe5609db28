"""Paged KV cache manager overhead per scheduler step (us per request), next to a dict-of-lists page table.

    python benchmarks/bench_manager.py [--quick] [--json FILE] [--contention N] [--max-python PATH]

``--max-python`` names the interpreter of MAX's environment (``.venv-max/bin/python``,
``benchmarks/setup_max_peer.sh``): it then runs ``benchmarks/max_manager_peer.py --serve``
there and adds a ``max`` column, MAX's own paged KV cache manager on the same
workload, timed in the same rounds as ours (ours, MAX, ours, MAX, ...). MAX
hashes pages with its default ``ahash64``, sparsekv with SHA-256.
"""

import argparse
import contextlib
from pathlib import Path

from sparsekv.bench import manager
from sparsekv.bench.common import busy_processes, format_table, rows_to_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small batch")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="run with N busy processes competing for the CPUs (stopped at the end)")
    parser.add_argument("--max-python", type=Path, metavar="PATH",
                        help="Python of MAX's environment: adds the MAX manager peer column")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        peer = None
        if args.max_python is not None:
            peer = stack.enter_context(
                manager.MaxManagerPeer(args.max_python, Path(__file__).with_name("max_manager_peer.py")))
            print(f"MAX manager peer: max {peer.info['max']}, {peer.info['hash']} page hashes")
        load = stack.enter_context(busy_processes(args.contention))
        rows = manager.run(quick=args.quick, max_peer=peer)
    print(format_table(rows, load))
    for row in rows:
        print(f"{row.op:24s} {row.shape:32s} {row.note}")
    if args.json:
        args.json.write_text(rows_to_json(rows, load))
