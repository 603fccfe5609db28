"""QSA ops (compress, block score, select, sparse attention) next to the reference, a torch copy and peers.

    python benchmarks/bench_qsa.py [--quick] [--json FILE] [--contention N] [--threads N] [--max-python .venv-max/bin/python]

``--max-python`` names a Python that has Modular MAX installed (see
``benchmarks/setup_max_peer.sh``); it runs ``benchmarks/max_peer.py`` for a
``max`` peer column on the compress and decode block-score rows.
"""

import argparse
from pathlib import Path

from sparsekv.bench import qsa
from sparsekv.bench.common import busy_processes, format_table, rows_to_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape per op")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="run with N busy processes competing for the CPUs (stopped at the end)")
    parser.add_argument("--max-python", help="a Python with Modular MAX, for the 'max' peer column")
    parser.add_argument("--threads", type=int, help="threads for torch, numba and MAX (default: their own)")
    args = parser.parse_args()
    with busy_processes(args.contention) as load:
        rows = qsa.run(quick=args.quick, max_python=args.max_python, threads=args.threads)
    print(format_table(rows, load))
    for row in rows:
        if row.note:
            print(f"{row.op} {row.shape} {row.dtype}: {row.note}")
    if args.json:
        args.json.write_text(rows_to_json(rows, load))
