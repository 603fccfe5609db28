"""The ``sparsekv`` command: ``sparsekv demo``, ``sparsekv bench`` and ``sparsekv generate``.

Exit status: 0 on success; 1 when a demo check fails; 2 for a usage,
config or checkpoint error (the message names the problem). Output paths
(``--plot``, ``bench --json``) are checked before anything runs.

Examples::

    sparsekv demo                                 # embedded model, 8 requests x 2048 tokens, report
    sparsekv demo --requests 2 --context 64 --json
    sparsekv demo --checkpoint ckpt/ --plot decode.png
    sparsekv bench --quick --only qsa,kpool --json bench.json
    sparsekv generate --model ckpt/ --prompt-tokens 4096 --new-tokens 32   # a local HF checkpoint
    sparsekv bench --only qsa --contention 2      # the same with two busy processes competing
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence

from .integrations.generate import add_generate_arguments

BENCH_FAMILIES = ("qsa", "kpool", "mla", "cache", "manager")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def output_path_problem(option: str, path: str, suffixes: tuple[str, ...] | None = None) -> str | None:
    """Why ``path`` cannot receive the output of ``option`` (``None`` when it can), found before any work runs.

    The path must name a file (not a folder) in an existing, writable folder,
    ending in one of ``suffixes`` when given. An existing file is
    opened for appending and closed (its contents and size stay as they are);
    otherwise a temporary file is created in the folder and removed.
    """
    if suffixes is not None and not path.lower().endswith(suffixes):
        return f"{option}: expected a file name ending in {', '.join(suffixes)}, got {path!r}"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{option}: expected a file name, got the folder {path!r}"
    if not os.path.isdir(folder):
        return f"{option}: the folder {folder!r} of {path!r} does not exist"
    try:
        if os.path.exists(path):
            with open(path, "ab"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
    except OSError as err:
        return f"{option}: cannot write {path!r} ({err.strerror or err})"
    return None


def plot_problem(path: str) -> str | None:
    """Why ``--plot path`` cannot work (matplotlib missing, bad suffix or place), else ``None``."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        return (f"--plot needs matplotlib, which cannot be imported ({err}); install it with "
                "`pip install matplotlib` (or `pip install sparsekv[bench]`)")
    return output_path_problem("--plot", path, PLOT_SUFFIXES)


def _usage_error(command: str, message: str) -> int:
    print(f"sparsekv {command}: error: {message}", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoError, DemoOptions, run_demo
    from .demo_report import format_report
    from .demo_sweep import write_plot

    if args.plot and (problem := plot_problem(args.plot)):
        return _usage_error("demo", problem)
    if args.tp != 1:
        from .demo_tp import TPCheckOptions, check_tp_options
        tp_options = TPCheckOptions(tp=args.tp, device=args.device, seed=args.seed)
        try:
            check_tp_options(tp_options)
        except ValueError as err:
            return _usage_error("demo", f"--tp {args.tp}: {err}")
    options = DemoOptions(device=args.device, dtype=args.dtype, configs=args.config or [],
                          checkpoints=args.checkpoint or [], requests=args.requests, context=args.context,
                          decode_tokens=args.decode_tokens, shared_prefix=args.shared_prefix,
                          step_tokens=args.step_tokens, page_size=args.page_size, seed=args.seed,
                          sweep=bool(args.plot or args.sweep), sweep_context=args.sweep_context,
                          progress=not args.no_progress)
    try:
        report = run_demo(options)
    except DemoError as err:
        return _usage_error("demo", str(err))
    if args.tp != 1:
        from .demo_tp import RankError, run_tp_check
        try:
            report["tensor_parallel"] = run_tp_check(tp_options)
        except (RankError, ValueError) as err:
            return _usage_error("demo", f"--tp {args.tp}: {err}")
        report["checks_passed"] = report["checks_passed"] and report["tensor_parallel"]["passed"]
    if args.plot:
        write_plot(report["decode_sweep"], args.plot,
                   f"Attention per decode token, {len(report['model']['qwen4_exp']['qsa_layers'])} QSA layers "
                   f"({report['workload']['device']} {report['workload']['dtype']})")
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if "tensor_parallel" in report:
            from .demo_tp import format_tp_report
            print(format_tp_report(report["tensor_parallel"]))
        if args.plot:
            print(f"  plot written to {args.plot}")
    return 0 if report["checks_passed"] else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench.common import busy_processes, format_table, rows_to_json

    if args.contention < 0:
        return _usage_error("bench", f"--contention: expected a number of busy processes >= 0, got {args.contention}")
    families = BENCH_FAMILIES if not args.only else tuple(f.strip() for f in args.only.split(",") if f.strip())
    unknown = [f for f in families if f not in BENCH_FAMILIES]
    if unknown or not families:
        return _usage_error("bench", f"--only: unknown benchmark {', '.join(unknown) or '(empty)'}; "
                                     f"choose from {', '.join(BENCH_FAMILIES)}")
    if args.plot and (problem := plot_problem(args.plot)):
        return _usage_error("bench", problem)
    if args.json and (problem := output_path_problem("--json", args.json)):
        return _usage_error("bench", problem)
    modules = []
    for family in families:
        try:
            modules.append(importlib.import_module(f"sparsekv.bench.{family}"))
        except ModuleNotFoundError as err:
            print(f"sparsekv bench: error: benchmark module sparsekv.bench.{family} is missing ({err})",
                  file=sys.stderr)
            return 2
    rows = []
    with busy_processes(args.contention) as load:
        for family, module in zip(families, modules):
            print(f"running {family} benchmarks{' (quick)' if args.quick else ''}...", file=sys.stderr)
            rows += module.run(quick=args.quick)
    print(format_table(rows, load))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(rows_to_json(rows, load))
            handle.write("\n")
    if args.plot:
        _plot_bench(rows, args.plot)
    return 0


def _plot_bench(rows, path: str) -> None:
    """One horizontal bar per measured row: achieved GB/s (label: op, shape, dtype, backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.op} {r.shape} {r.dtype} {r.backend}" for r in rows]
    figure, axes = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    axes.barh(range(len(rows)), [r.gb_per_s for r in rows])
    axes.set_yticks(range(len(rows)), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("GB/s (bytes the op must move / median time)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsekv", description="Paged KV cache and sparse-attention indexers.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="serve a small workload with QSA and sparse MLA attention, then report",
                               description="Serve requests that share a system prompt through the paged cache "
                                           "manager (chunked prefill, decode, prefix caching) on a Qwen4Exp QSA "
                                           "slice and a GLM-5-Next MLA slice (k-pool indexer + sparse MLA); "
                                           "check every step against dense oracles and print a report. Exits 1 "
                                           "if a check fails.")
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    demo.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default) or float16")
    demo.add_argument("--config", action="append", metavar="CONFIG_JSON",
                      help="a config.json as HF writes it: qwen4_exp replaces the QSA slice's config, "
                           "glm5_next, glm_moe_dsa or deepseek_v32 the MLA slice's (seeded weights); "
                           "may be given once per slice")
    demo.add_argument("--checkpoint", action="append", metavar="DIR",
                      help="a folder with config.json and *.safetensors (same families) whose weights "
                           "replace that slice's; may be given once per slice")
    demo.add_argument("--requests", type=int, default=8, help="requests to serve (default 8)")
    demo.add_argument("--context", type=int, default=2048, help="prompt tokens per request (default 2048)")
    demo.add_argument("--decode-tokens", type=int, default=32, help="decode steps per request (default 32)")
    demo.add_argument("--shared-prefix", type=int, default=None, metavar="TOKENS",
                      help="system prompt tokens every request shares (default: 3/4 of the context, whole pages)")
    demo.add_argument("--step-tokens", type=int, default=512, help="token budget per batch step (default 512)")
    demo.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    demo.add_argument("--sweep", action="store_true",
                      help="also time one decode token's attention against context: QSA vs dense torch SDPA")
    demo.add_argument("--sweep-context", type=int, default=None, metavar="TOKENS",
                      help="longest context of the decode sweep (default: max(--context, 8192))")
    demo.add_argument("--plot", metavar="FILE.png",
                      help="run the decode sweep and plot it (.png, .svg or .pdf; needs matplotlib)")
    demo.add_argument("--tp", type=int, default=1, metavar="N",
                      help="also run a head-sharded QSA slice over N processes (gloo on CPU, NCCL on CUDA) "
                           "and check it equals the single-process run (default 1: off)")
    demo.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.set_defaults(handler=_demo)

    bench = commands.add_parser("bench", help="benchmark the ops and the cache manager",
                                description="Run the benchmark modules and print one table.")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    bench.add_argument("--only", metavar="LIST", help=f"comma-separated subset of {','.join(BENCH_FAMILIES)}")
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    bench.add_argument("--contention", type=int, default=0, metavar="N",
                       help="run with N busy processes competing for the CPUs, stopped at the end (default 0); "
                            "the table states the load")
    bench.add_argument("--plot", metavar="FILE.png", help="bar chart of GB/s per row (.png, .svg or .pdf; "
                                                           "needs matplotlib)")
    bench.set_defaults(handler=_bench)

    add_generate_arguments(commands.add_parser(
        "generate", help="run a local Hugging Face checkpoint (config.json + safetensors) through sparsekv"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
