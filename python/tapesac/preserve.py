"""The measured trials ``TapeSAC(preserve="auto")`` chooses from, and the choice itself.

When a block's replay reads a tensor the step later overwrites (a memory bank updated in a few rows, a queue rotated,
an input modified in place), tapesac keeps the replay exact by saving the overwritten regions (``"regions"``),
copying the whole storage (``"snapshots"``) or keeping the activations that would read it (``"keep"``);
``preserve="auto"`` measures the three in turn and keeps the best. The choice is made in C++
(``runtime/preservation_chooser.h``, Note [Preservation choice]); this module holds what Python needs of it: the
trial record ``TapeSAC.preservation_trials`` returns, and ``pick()``. The accepted values are ``config.PRESERVE_MODES``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from . import _C

__all__ = ["Trial", "pick"]


@dataclass(frozen=True)
class Trial:
    """One measured step under one preservation mode, or (``measured`` false) a mode left untried because under the
    memory limit it might not have fitted: ``peak_bytes`` is then the bound that was over the limit (-1: none known),
    Note [Trials under a limit] in ``runtime/preservation_chooser.h``."""

    mode: str
    peak_bytes: int
    cost_ms: float  # replay time plus the preservation's own saving and rebuilding time
    measured: bool = True


def pick(trials: Iterable[Trial], limit: int | None) -> str:
    """The mode to keep: without a limit the lowest measured peak (ties: the cheapest); with one, the cheapest of
    the modes whose measured peak stays under it, else the lowest peak; untried modes are never picked. Raises
    ConfigError (a ValueError) without a measured trial."""
    return _C.pick_preservation([(t.mode, t.peak_bytes, t.cost_ms) for t in trials if t.measured], limit or 0)
