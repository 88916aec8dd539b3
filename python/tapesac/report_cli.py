"""``python -m tapesac report LOG.jsonl [LOG2.jsonl ...] [--plot PNG] [--json PATH]``: prints the summary of each
telemetry log a ``TapeSAC(log=...)`` wrote and writes one PNG comparing them: per log, the memory timeline of
the latest step that logged one (steps 1, 2, 10 and every 100th) and the per-block kept / dropped / replayed
bytes of the last step."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from .errors import ConfigError
from .report import StepReport, plot_reports


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tapesac report", description=__doc__)
    ap.add_argument("logs", nargs="+", help="JSON-lines telemetry files written with TapeSAC(log=...)")
    ap.add_argument("--plot", default=None, help="PNG to write (default: <first log>.png)")
    ap.add_argument("--json", default=None, help="write the reports as a JSON list")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        reports = [StepReport.from_jsonl(p) for p in args.logs]
    except ConfigError as e:
        print(f"tapesac report: {e}", file=sys.stderr)
        return 2
    for path, rep in zip(args.logs, reports):
        print(f"== {path}")
        print(rep.pretty())
        print()
    plot = Path(args.plot) if args.plot else Path(args.logs[0]).with_suffix(".png")
    plot_reports(reports, plot, labels=[f"{Path(p).name} ({r.policy})" for p, r in zip(args.logs, reports)])
    print(f"plot: {plot}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in reports], indent=2, sort_keys=True) + "\n")
        print(f"json: {args.json}")
    return 0
