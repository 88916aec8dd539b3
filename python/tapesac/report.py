"""StepReport: what tapesac did in the last step (and a summary of the steps before), as JSON or a table.

Frozen, versioned (``schema_version``); ``to_dict()`` is the JSON form, ``from_dict()`` reads it back.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .core import BlockStats, StepStats

__all__ = ["StepReport"]

SCHEMA_VERSION = 1


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


@dataclass(frozen=True)
class StepReport:
    """Report of a TapeSAC run: the last step per block, and medians over all steps."""

    schema_version: int
    steps: int
    policy: str
    blocks: tuple[str, ...]
    last: dict[str, Any] | None
    median_step_ms: float | None
    median_replay_ms: float | None
    ops_replayed_by_name: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_history(cls, history: Sequence[StepStats], blocks: Sequence[str]) -> "StepReport":
        last = history[-1] if history else None
        return cls(
            schema_version=SCHEMA_VERSION,
            steps=len(history),
            policy=last.policy if last else "",
            blocks=tuple(blocks),
            last=asdict(last) if last else None,
            median_step_ms=statistics.median(s.step_ms for s in history) if history else None,
            median_replay_ms=statistics.median(s.replay_ms for s in history) if history else None,
            ops_replayed_by_name=dict(last.ops_replayed_by_name) if last else {},
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepReport":
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"StepReport schema_version {d.get('schema_version')!r} is not {SCHEMA_VERSION}")
        d = dict(d)
        d["blocks"] = tuple(d["blocks"])
        return cls(**d)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def pretty(self) -> str:
        if self.last is None:
            return "tapesac: no step has run yet"
        last = self.last
        lines = [
            f"tapesac report — policy {self.policy!r}, {self.steps} step(s), median step {self.median_step_ms:.1f} ms, "
            f"median replay {self.median_replay_ms:.1f} ms",
            f"last step: {last['block_calls']} block call(s), {last['ops_recorded']} ops recorded, "
            f"{last['saved_tensors']} tensors saved: {last['kept_tensors']} kept ({_mib(last['kept_bytes'])} MiB), "
            f"{last['dropped_tensors']} dropped ({_mib(last['dropped_bytes'])} MiB), {last['opaque_tensors']} opaque; "
            f"{last['ops_replayed']} ops replayed in {last['replays']} replay(s)",
            "",
            f"{'block':<28}{'ops':>6}{'saved':>7}{'kept MiB':>10}{'dropped MiB':>13}{'replayed':>10}{'replay ms':>11}",
        ]
        for b in last["blocks"]:
            lines.append(
                f"{b['name'][:27]:<28}{b['ops_recorded']:>6}{b['saved_tensors']:>7}{_mib(b['kept_bytes']):>10}"
                f"{_mib(b['dropped_bytes']):>13}{b['ops_replayed']:>10}{b['replay_ms']:>11.2f}"
            )
        if self.ops_replayed_by_name:
            top = sorted(self.ops_replayed_by_name.items(), key=lambda kv: -kv[1])[:8]
            lines += ["", "replayed ops: " + ", ".join(f"{k} ×{v}" for k, v in top)]
        return "\n".join(lines)
