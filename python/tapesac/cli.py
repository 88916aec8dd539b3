"""The ``tapesac`` command line: ``tapesac COMMAND [options]`` (the console script) or ``python -m tapesac COMMAND``.

Contract:
- argparse subcommands, one per job (``COMMANDS``). Each lives in its own module as ``add_arguments(parser)`` and
  ``run(args) -> int``; the module's ``main(argv)`` runs ``tapesac COMMAND argv...`` through here.
- ``tapesac --version`` prints the version; ``--debug`` (before or after the command) shows tracebacks.
- Errors print one line on stderr, never a traceback without ``--debug``: a user error (a TapeSACError such as
  ConfigError or MemoryLimitError, a missing or unwritable file, a bad option value) as ``tapesac COMMAND: error:
  ...`` with exit status 2; anything else as one line naming the exception and asking for ``--debug``, exit status 1.
- While a command runs, the ``tapesac`` logger's warnings and info lines go to stderr, one line each (log.py).
- ``main(argv)`` returns the exit status and never calls sys.exit (tests call it in-process).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from .errors import TapeSACError

__all__ = ["COMMANDS", "build_parser", "main"]

# command -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS = {
    "demo": ("demo", "train a small Qwen3-style model on real text with tapesac and print its report"),
    "validate": ("validate_cli", "run one training step with and without tapesac and compare loss and gradients"),
    "report": ("report_cli", "summarize telemetry logs (TapeSAC(log=...)) and optionally plot them"),
    "frontier": ("frontier_cli", "measure the memory/time plane of one model and draw it with the planner's frontier"),
    "bench": ("bench.cli", "run the side-by-side benchmark suite (no checkpointing, PyTorch checkpoint/SAC, tapesac)"),
}


def _version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (each command's options come from its module)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    p = argparse.ArgumentParser(prog="tapesac", parents=[common],
                                description="tapesac: automatic selective activation checkpointing for PyTorch.")
    p.add_argument("--version", action="version", version=f"tapesac {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, text) in COMMANDS.items():
        mod = importlib.import_module(f".{module}", __package__)
        sp = sub.add_parser(name, help=text, description=getattr(mod, "DESCRIPTION", text), parents=[common],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, (TapeSACError, OSError))


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(args_in)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    debug = bool(getattr(args, "debug", False))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("tapesac")
    log.addHandler(handler)
    level = log.level
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    try:
        return int(args._run(args) or 0)
    except SystemExit as e:
        if isinstance(e.code, str):  # a command's own usage error, e.g. "--steps must be >= 1, got 0"
            if debug:
                raise
            print(f"tapesac {args.command}: error: {e.code}", file=sys.stderr)
            return 2
        return int(e.code or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"tapesac {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, the traceback only with --debug
        if debug:
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        if _is_user_error(e):
            print(f"tapesac {args.command}: error: {text}", file=sys.stderr)
            return 2
        print(f"tapesac {args.command}: internal error: {type(e).__name__}: {text} (rerun with --debug for the "
              f"traceback, and report it)", file=sys.stderr)
        return 1
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def run_module(command: str, argv: Sequence[str] | None) -> int:
    """``main(argv)`` of a command's module: ``tapesac COMMAND argv...``."""
    return main([command, *(sys.argv[1:] if argv is None else list(argv))])
