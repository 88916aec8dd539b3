"""Choosing how to preserve external tensors a step writes in place after a block's forward.

When a block's replay reads a tensor the step later overwrites (a memory bank updated in a few rows, a queue rotated,
an input modified in place), tapesac can keep the replay exact in three ways (README: "Replay contracts"):

* ``"regions"``: save the overwritten region's old bytes just before each write, and rebuild a private copy for each
  replay (held: the regions; during a replay also one copy of the storage);
* ``"snapshots"``: copy the whole storage at its first write; replays read the copy itself (held: the storage's
  size, from the first write to the step's end);
* ``"keep"``: keep the activations whose replay would read it (held: their bytes; no replay of them).

Which is best depends on where the step's peak falls and on how the writes are spread, which a model of the
step cannot see well (a region rebuild allocates a copy of the storage during each replay; whether that copy sits
at the peak depends on the backward's schedule). So ``preserve="auto"`` measures instead: the steps that first write
such tensors run ``"regions"``, ``"snapshots"`` and ``"keep"`` in turn (each exact), and ``pick()`` chooses from
their measured peaks and costs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["PRESERVE_MODES", "EXPLORED", "Trial", "pick"]

PRESERVE_MODES = ("auto", "regions", "snapshots", "keep", "off")
EXPLORED = ("regions", "snapshots", "keep")


@dataclass(frozen=True)
class Trial:
    """One measured step under one preservation mode."""

    mode: str
    peak_bytes: int
    cost_ms: float  # replay time plus the preservation's own saving and rebuilding time


def pick(trials: Iterable[Trial], limit: int | None) -> str:
    """The mode to keep: without a limit the lowest measured peak (ties: the cheapest); with one, the cheapest of
    the modes whose measured peak stays under it, else the lowest peak."""
    trials = list(trials)
    if not trials:
        raise ValueError("pick() needs at least one measured trial")
    if limit:
        fits = [t for t in trials if t.peak_bytes <= limit]
        if fits:
            return min(fits, key=lambda t: (t.cost_ms, t.peak_bytes)).mode
    return min(trials, key=lambda t: (t.peak_bytes, t.cost_ms)).mode
