"""Checks of the commands' numeric options, run before the job: a bad value is a usage error (one line,
`tapesac CMD: error: ...`, exit status 2: see tapesac.cli) instead of an exception deep in the job reported as an
internal error (`--batch 0` used to fail inside the data loader, `--heads 0` with a ZeroDivisionError)."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["at_least", "positive_finite", "writable"]


def at_least(option: str, value: int | None, minimum: int) -> None:
    """SystemExit (a usage error) unless `value` is None or >= `minimum`."""
    if value is not None and value < minimum:
        raise SystemExit(f"{option} must be >= {minimum}, got {value}")


def positive_finite(option: str, value: float | None) -> None:
    """SystemExit (a usage error) unless `value` is None or a finite number > 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise SystemExit(f"{option} must be a finite number > 0, got {value}")


_FIGURE_SUFFIXES = {".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp"}


def writable(option: str, value: str | None, figure: bool = False) -> None:
    """SystemExit (a usage error) unless `value` is None or a file path the job can write at its end: its folder
    exists, it is not a folder, and (a figure) its suffix is an image format. Checked first, so that a long job does
    not end in an error writing its result (`tapesac report --plot x.foo` was an internal error)."""
    if value is None:
        return
    path = Path(value)
    if not value or path.is_dir():
        raise SystemExit(f"{option} must be a file path, got {value!r} (a folder or nothing)")
    if not path.resolve().parent.is_dir():
        raise SystemExit(f"{option} {value}: the folder {str(path.parent)!r} does not exist; create it first")
    if figure and path.suffix.lower() not in _FIGURE_SUFFIXES:
        raise SystemExit(f"{option} {value}: not an image format; use one of .png, .pdf, .svg")
