"""What the trainer integrations log: a few numbers per logging interval, from the tapesac steps in it.

``step_metrics(steps)`` maps a list of StepStats (the steps since the last log, oldest first) to flat floats named
``tapesac/...``: ``steps`` (how many), ``peak_mib`` (the largest step peak, baseline included: StepStats.memory
.peak_bytes, the one definition of a step's peak), ``kept_mib`` and ``dropped_mib`` (the last step's saved tensors
kept and dropped), ``replay_ms`` (mean replay time per step) and ``step_ms`` (mean wall time of a step). Empty when
there were no steps.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["step_metrics"]

MiB = float(2**20)


def step_metrics(steps: Sequence[Any]) -> dict[str, float]:
    if not steps:
        return {}
    last = steps[-1]
    peaks = [s.memory.peak_bytes for s in steps if s.memory is not None]
    out = {
        "tapesac/steps": float(len(steps)),
        "tapesac/kept_mib": last.kept_bytes / MiB,
        "tapesac/dropped_mib": last.dropped_bytes / MiB,
        "tapesac/replay_ms": sum(s.replay_ms for s in steps) / len(steps),
        "tapesac/step_ms": sum(s.step_ms for s in steps) / len(steps),
    }
    if peaks:
        out["tapesac/peak_mib"] = max(peaks) / MiB
    return out
