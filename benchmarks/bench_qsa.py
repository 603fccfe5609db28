"""QSA ops (compress, block score, select, sparse attention) next to the reference, a torch copy and peers.

    python benchmarks/bench_qsa.py [--quick] [--only OPS] [--json FILE] [--contention N] [--threads N]
                                   [--max-python .venv-max/bin/python] [--threads-check]

``--max-python`` names a Python that has Modular MAX installed (see
``benchmarks/setup_max_peer.sh``); each compress and decode block-score row
then starts ``benchmarks/max_peer.py --serve`` there and times MAX's kernel
for a ``max`` peer column in the same rounds as ours (stopped when the row
ends). ``--only compress,block_score`` keeps the rows of those ops.
``--threads-check`` times ours against the same op on one thread only, in
120 rounds: with other peers in the rounds (another process's threads above
all), two calls of a millisecond are not compared under the same
conditions; this is the check that threads never hurt, quiet or with
``--contention N``.
"""

import argparse
from pathlib import Path

from sparsekv.bench import qsa
from sparsekv.bench.common import busy_processes, format_table, rows_to_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape per op")
    parser.add_argument("--only", type=lambda text: [op.strip() for op in text.split(",") if op.strip()],
                        help=f"comma-separated ops to run, from {','.join(qsa.OPS)} (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="run with N busy processes competing for the CPUs (stopped at the end)")
    parser.add_argument("--max-python", help="a Python with Modular MAX, for the 'max' peer column")
    parser.add_argument("--threads", type=int, help="threads for torch, numba and MAX (default: their own)")
    parser.add_argument("--threads-check", action="store_true",
                        help="ours and the 1thread peer only, 120 rounds (ignores --max-python)")
    args = parser.parse_args()
    if args.only is not None and (not args.only or set(args.only) - set(qsa.OPS)):
        parser.error(f"--only: expected ops from {','.join(qsa.OPS)}, got {','.join(args.only) or 'nothing'}")
    with busy_processes(args.contention) as load:
        rows = qsa.run(quick=args.quick, max_python=args.max_python, threads=args.threads, ops=args.only,
                       check_threads=args.threads_check)
    print(format_table(rows, load))
    for row in rows:
        if row.note:
            print(f"{row.op} {row.shape} {row.dtype}: {row.note}")
    if args.json:
        args.json.write_text(rows_to_json(rows, load))
