"""Checks of the commands' numeric options, run before the job: a bad value is a usage error (one line,
`tapesac CMD: error: ...`, exit status 2: see tapesac.cli) instead of an exception deep in the job reported as an
internal error (`--batch 0` used to fail inside the data loader, `--heads 0` with a ZeroDivisionError)."""

from __future__ import annotations

import math

__all__ = ["at_least", "positive_finite"]


def at_least(option: str, value: int | None, minimum: int) -> None:
    """SystemExit (a usage error) unless `value` is None or >= `minimum`."""
    if value is not None and value < minimum:
        raise SystemExit(f"{option} must be >= {minimum}, got {value}")


def positive_finite(option: str, value: float | None) -> None:
    """SystemExit (a usage error) unless `value` is None or a finite number > 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise SystemExit(f"{option} must be a finite number > 0, got {value}")
