"""The ``python -m tapesac`` command line: one subcommand per job, each forwarding its options."""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

# command -> (module with main(argv) -> int, one-line help)
COMMANDS = {
    "demo": ("demo", "train a small Qwen3-style model on real text with tapesac and print its report"),
    "report": ("report_cli", "summarize a telemetry log (TapeSAC(log=...)) and write its plots"),
    "frontier": ("frontier_cli", "measure the memory/time plane of one model and draw it with the planner's frontier"),
    "bench": ("bench", "run the side-by-side benchmark suite (no checkpointing, PyTorch checkpoint/SAC, tapesac)"),
}


def _usage() -> str:
    lines = ["usage: python -m tapesac COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"tapesac: unknown command {command!r}; expected one of {sorted(COMMANDS)}\n\n{_usage()}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f".{COMMANDS[command][0]}", __package__)
    return int(module.main(rest) or 0)
