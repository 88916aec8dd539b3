"""The memory/time plane: the planner's frontier (predicted) and measured points (tapesac steps, and with
``python -m tapesac frontier`` the peers: no checkpointing, PyTorch checkpoint and SAC, tapesac full and auto).

``Frontier.pretty()`` is a table; ``Frontier.plot(path)`` a PNG with the frontier as a line and every measured
point as a marker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .plotting import pyplot, save_figure

__all__ = ["Frontier"]


@dataclass(frozen=True)
class Frontier:
    """``planned``: [{limit_bytes, predicted_peak_bytes, predicted_replay_ms, kept_bytes}] in ascending memory;
    ``measured``: [{peak_bytes, replay_ms, step_ms, policy or label, ...}]."""

    planned: list[dict[str, Any]]
    measured: list[dict[str, Any]] = field(default_factory=list)
    limit_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def pretty(self) -> str:
        lines = ["planner frontier (predicted from the measured op times and the calibrated peak model):",
                 f"{'limit MiB':>10}{'peak MiB':>10}{'kept MiB':>10}{'replay ms':>11}"]
        for p in self.planned:
            lines.append(f"{p['limit_bytes'] / 2**20:>10.2f}{p['predicted_peak_bytes'] / 2**20:>10.2f}"
                         f"{p['kept_bytes'] / 2**20:>10.2f}{p['predicted_replay_ms']:>11.3f}")
        if self.measured:
            lines += ["", "measured:", f"{'label':<34}{'peak MiB':>10}{'step ms':>10}{'replay ms':>11}"]
            for m in self.measured:
                label = str(m.get("label") or f"tapesac step {m.get('step')} ({m.get('policy')})")
                lines.append(f"{label[:33]:<34}{m['peak_bytes'] / 2**20:>10.2f}{m.get('step_ms', float('nan')):>10.1f}"
                             f"{m.get('replay_ms', float('nan')):>11.3f}")
        return "\n".join(lines)

    def plot(self, path: str | Path, extra: Sequence[dict[str, Any]] = (), title: str | None = None) -> Path:
        plt = pyplot("Frontier.plot")
        fig, ax = plt.subplots(figsize=(8, 5.5))
        if self.planned:
            ax.plot([p["predicted_peak_bytes"] / 2**20 for p in self.planned],
                    [p["predicted_replay_ms"] for p in self.planned], "-o", color="#1f77b4", markersize=4,
                    label="tapesac planner frontier (predicted replay time)")
        for m in [*self.measured, *extra]:
            y = m.get("plot_y", m.get("replay_ms"))
            if y is None:
                continue
            ax.scatter([m["peak_bytes"] / 2**20], [y], marker=m.get("marker", "s"), s=50,
                       label=m.get("label") or f"tapesac step {m.get('step')} ({m.get('policy')})", zorder=3)
        if self.limit_bytes:
            ax.axvline(self.limit_bytes / 2**20, color="black", linestyle="--", linewidth=1, label="memory_limit")
        ax.set_xlabel("step peak (MiB)")
        ax.set_ylabel("recompute time per step (ms)")
        ax.set_title(title or "memory / time plane")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper right")
        fig.tight_layout()
        return save_figure(plt, fig, path, "Frontier.plot")
