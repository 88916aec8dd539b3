"""``tapesac report LOG.jsonl [LOG2.jsonl ...] [--plot PNG] [--json PATH]``: prints the summary of each telemetry log
a ``TapeSAC(log=...)`` wrote; with ``--plot``, one PNG comparing them: per log, the memory timeline of the latest
step that logged one (steps 1, 2, 10 and every 100th) and the per-block kept / dropped / replayed bytes of the last
step. The summary needs nothing but tapesac; the plot needs matplotlib (``pip install 'tapesac[plot]'``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from .report import StepReport, plot_reports

__all__ = ["add_arguments", "run", "main"]

DESCRIPTION = __doc__


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("logs", nargs="+", help="JSON-lines telemetry files written with TapeSAC(log=...)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also write a PNG comparing the logs (matplotlib)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the reports as a JSON list")


def run(args: argparse.Namespace) -> int:
    from .cli_args import writable

    writable("--plot", args.plot, figure=True)
    writable("--json", args.json)
    reports = [StepReport.from_jsonl(p) for p in args.logs]  # ConfigError: one line, exit status 2
    for path, rep in zip(args.logs, reports):
        print(f"== {path}")
        print(rep.pretty())
        print()
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in reports], indent=2, sort_keys=True) + "\n")
        print(f"json: {args.json}")
    if args.plot:
        plot = plot_reports(reports, Path(args.plot),
                            labels=[f"{Path(p).name} ({r.policy})" for p, r in zip(args.logs, reports)])
        print(f"plot: {plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``tapesac report argv...`` (one-line errors; see tapesac.cli)."""
    from .cli import run_module

    return run_module("report", argv)

