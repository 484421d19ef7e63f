"""`subnet-train`: train with SDP, DDP or FSDP2, and compare them side by side.

    subnet-train --method sdp --level block --regime forward --coverage 0.5 --nproc 2
    torchrun --nproc-per-node 8 -m subnet_ext.cli.train --method sdp --model llama --preset 134m ...
    subnet-train compare            # DDP and the four SDP variants, one table (make demo)
"""
from __future__ import annotations

import sys

from ..jobs.arguments import METHODS, MODELS, build_parser, check_args, training_args  # noqa: F401  (the CLI's API)
from ..jobs.launch import exit_worker, under_torchrun
from ..jobs.runner import run

def main(argv: list[str] | None = None) -> int:
    """Entry point of `subnet-train` (also `subnet-train compare ...`): parse, run, print the report
    table; returns the exit code (1 when the run stopped on a detected failure)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "compare":
        from .compare import main as compare_main

        return compare_main(argv[1:])
    if argv and argv[0] == "train":
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    from ..jobs.launch import WorkerError, clean_stop_types

    torchrun = under_torchrun()  # before run(): a one-process run sets the same variables itself
    try:
        report = run(args)
    except clean_stop_types() + (WorkerError,) as e:
        # Failures the run detected and stopped on cleanly: one message, no traceback.
        print(f"subnet-train: stopped: {e}", file=sys.stderr)
        if torchrun:
            exit_worker(1)
        return 1
    if torchrun:
        exit_worker(0)  # this process is one of torchrun's workers: see launch.exit_worker
    if report is not None:
        from ..jobs.report import markdown_table

        print(markdown_table([report], baseline_label=report["label"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
