"""StepReport: what tapesac did in the last step (and a summary of the steps before), as JSON, a table or a plot.

Frozen, versioned (``schema_version``); ``to_dict()`` is the JSON form, ``from_dict()`` reads it back. The JSON
lines a ``TapeSAC(..., log=path)`` writes are one ``StepStats`` each (``kind: "step"``); ``from_jsonl()`` turns
such a file into a report (``python -m tapesac report FILE``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .errors import ConfigError
from .log import logger
from .plotting import pyplot, save_figure, write_output
from .stats import SCHEMA_VERSION, StepStats

__all__ = ["StepReport", "SCHEMA_VERSION", "median_of_steps"]


_PHASE_COLORS = {"forward": "#1f77b4", "backward": "#d62728", "replay": "#2ca02c"}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def median_of_steps(values: Sequence[float]) -> float | None:
    """The median of a per-step figure over the steps after the first (step 1 records every tape and measures: a
    warm-up), over the one step when there is only one; None without steps. The one definition of "median step"
    that StepReport, ``tapesac report`` and ``tapesac demo`` print."""
    values = list(values)
    if not values:
        return None
    return statistics.median(values[1:] if len(values) > 1 else values)


@dataclass(frozen=True)
class StepReport:
    """Report of a TapeSAC run: the last step per block, its memory and timeline, and medians over all steps.

    ``last`` is the last StepStats as a dict (``last["memory"]`` its MemoryStats); ``timeline`` is the last step's
    memory timeline: ``points`` = [t_ns, bytes above the step's start, phase] and ``spans`` = [kind, block,
    begin_ns, end_ns] (block forwards and replays). ``peaks`` is the step peak of every step (bytes), in order.
    """

    schema_version: int
    steps: int
    policy: str
    blocks: tuple[str, ...]
    last: dict[str, Any] | None
    median_step_ms: float | None  # median_of_steps: steps 2.. (step 1 is the warm-up)
    median_replay_ms: float | None
    ops_replayed_by_name: dict[str, int] = field(default_factory=dict)
    peaks: tuple[int, ...] = ()
    timeline: dict[str, Any] = field(default_factory=dict)
    over_limit_steps: tuple[int, ...] = ()  # the steps whose measured peak exceeded memory_limit (StepStats.over_limit)

    @classmethod
    def from_history(cls, history: Sequence[StepStats], blocks: Sequence[str],
                     timeline: dict[str, Any] | None = None, total_steps: int | None = None) -> "StepReport":
        # Through JSON so that a report and its to_dict()/from_dict() round trip compare equal (tuples -> lists).
        records = json.loads(json.dumps([asdict(s) for s in history]))
        rep = cls._from_records(records, blocks, timeline or {})
        if total_steps is not None and total_steps != rep.steps:
            rep = dataclasses.replace(rep, steps=total_steps)
        return rep

    @classmethod
    def _from_records(cls, records: Sequence[dict[str, Any]], blocks: Sequence[str],
                      timeline: dict[str, Any]) -> "StepReport":
        last = records[-1] if records else None
        return cls(
            schema_version=SCHEMA_VERSION,
            steps=len(records),
            policy=last["policy"] if last else "",
            blocks=tuple(blocks),
            last=last,
            median_step_ms=median_of_steps([r["step_ms"] for r in records]),
            median_replay_ms=median_of_steps([r["replay_ms"] for r in records]),
            ops_replayed_by_name=dict(last["ops_replayed_by_name"]) if last else {},
            peaks=tuple(int(r["memory"]["peak_bytes"]) for r in records if r.get("memory")),
            timeline={"points": list(timeline.get("timeline", [])), "spans": list(timeline.get("spans", []))},
            over_limit_steps=tuple(int(r["step"]) for r in records if r.get("over_limit")),
        )

    @classmethod
    def from_jsonl(cls, path: str | Path) -> "StepReport":
        """A report of the steps logged in a ``log=`` file (the last policy's run when several were appended)."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{str(p)!r} is not a file; expected the JSON-lines file given as TapeSAC(log=...)")
        records = []
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            raise ConfigError(f"{p} is not text; expected the JSON-lines file given as TapeSAC(log=...)") from None
        lines = text.splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if n == len(lines) and not text.endswith("\n") and n > 1:
                    # A run killed while writing leaves its last line cut (each record is written whole, with its
                    # newline): the steps before it are reported (an adversarial test; the whole log was refused).
                    logger.warning(f"tapesac: {p}:{n}: the last line is cut off (a run stopped while writing it); "
                                   f"reporting the {n - 1} line(s) before it")
                    break
                raise ConfigError(f"{p}:{n}: not a JSON line ({e.msg}); expected a tapesac telemetry log") from None
            if not isinstance(rec, dict):  # `null`, a list: internal errors before (adversarial test)
                raise ConfigError(f"{p}:{n}: expected a JSON object (a tapesac step record), got {type(rec).__name__}")
            if rec.get("kind") != "step" or rec.get("schema_version") != SCHEMA_VERSION:
                raise ConfigError(f"{p}:{n}: expected a tapesac step record with schema_version {SCHEMA_VERSION}, "
                                  f"got kind={rec.get('kind')!r} schema_version={rec.get('schema_version')!r}")
            records.append(rec)
        if not records:
            raise ConfigError(f"{p} holds no step records; run steps with TapeSAC(log={str(p)!r}) first")
        # A log is appended to: a run starts where the step numbers start again (each TapeSAC counts from 1). The
        # report is the last run's; mixing them labelled one policy with another run's medians and peaks.
        start = max((i for i in range(1, len(records)) if records[i].get("step", 0) <= records[i - 1].get("step", 0)),
                    default=0)
        records = records[start:]
        try:
            blocks = [b["name"] for b in records[-1]["blocks"]]
            timeline = next((r["timeline"] for r in reversed(records) if r.get("timeline")), {})
            for r in records:
                r.pop("timeline", None)
            return cls._from_records(records, list(dict.fromkeys(blocks)), timeline)
        except (KeyError, TypeError, AttributeError) as e:  # a record with the kind and version but not the fields
            raise ConfigError(f"{p}: a step record lacks a field a tapesac log has ({type(e).__name__}: {e}); expected "
                              f"the JSON-lines file given as TapeSAC(log=...)") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepReport":
        if not isinstance(d, dict):
            raise ConfigError(f"StepReport.from_dict expects the dict StepReport.to_dict() made, got {type(d).__name__}")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ConfigError(f"StepReport schema_version {d.get('schema_version')!r} is not {SCHEMA_VERSION}; "
                              f"it was written by another tapesac version")
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        if not required <= set(d) <= fields:  # KeyError / TypeError from inside before (adversarial test)
            raise ConfigError(f"StepReport.from_dict: expected the keys of StepReport.to_dict(); missing "
                              f"{sorted(required - set(d))}, unknown {sorted(set(d) - fields)}")
        d = dict(d)
        d["blocks"] = tuple(d["blocks"])
        d["peaks"] = tuple(d.get("peaks", ()))
        d["over_limit_steps"] = tuple(d.get("over_limit_steps", ()))
        return cls(**d)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            write_output(path, text + "\n", "StepReport.to_json")
        return text

    def pretty(self) -> str:
        if self.last is None:
            return "tapesac: no step has run yet"
        last = self.last
        lines = [
            f"tapesac report — policy {self.policy!r}, {self.steps} step(s), median step {self.median_step_ms:.1f} ms, "
            f"median replay {self.median_replay_ms:.1f} ms" + (" (steps 2..: step 1 is the warm-up)" if self.steps > 1
                                                               else ""),
            f"last step: {last['block_calls']} block call(s), {last['ops_recorded']} ops recorded, "
            f"{last['saved_tensors']} tensors saved: {last['kept_tensors']} kept ({_mib(last['kept_bytes'])} MiB), "
            f"{last['dropped_tensors']} dropped ({_mib(last['dropped_bytes'])} MiB), {last['opaque_tensors']} opaque; "
            f"{last['ops_replayed']} ops replayed in {last['replays']} replay(s)",
        ]
        if last.get("policy") == "auto":
            planned = sum(1 for b in last["blocks"] if b.get("planned"))
            lines.append(f"plan: {planned} of {len(last['blocks'])} block call(s) ran the plan (the others found no "
                         f"plan for their tape and ran 'full'; the planner re-plans after such a step)")
        if last.get("approx_units_total") or last.get("approx_heads_total"):
            blocks = last["blocks"]
            parts = []
            if last.get("approx_units_total"):
                parts.append(f"{last['approx_mlp']} gated MLP(s) in {sum(1 for b in blocks if b.get('approx_mlp'))} "
                             f"block call(s), {last['approx_units_recomputed']} of {last['approx_units_total']} hidden "
                             f"units recomputed")
            if last.get("approx_heads_total"):
                parts.append(f"{last['approx_attn']} attention(s) in {sum(1 for b in blocks if b.get('approx_attn'))} "
                             f"block call(s), {last['approx_heads_recomputed']} of {last['approx_heads_total']} heads "
                             f"recomputed")
            skipped = sum(b.get("approx_mlp_skipped", 0) + b.get("approx_attn_skipped", 0) for b in blocks)
            kept = sum(b.get("approx_kept_values", 0) for b in blocks)
            lines.append("approx: " + "; ".join(parts) + (f"; {skipped} found but replayed exactly" if skipped else "")
                         + (f"; {kept} value(s) kept (replay would read an approximated output)" if kept else ""))
        mem = last.get("memory")
        if mem:
            limit = mem.get("memory_limit")
            lines.append(
                f"memory ({mem['device']}): step peak {_mib(mem['peak_bytes'])} MiB = baseline "
                f"{_mib(mem['baseline_bytes'])} MiB (parameters, buffers, gradients) + "
                f"{_mib(mem['peak_above_baseline_bytes'])} MiB; allocated {_mib(mem['allocated_bytes'])} MiB in the "
                f"step; replay arena {_mib(mem['arena_bytes'])} MiB (one pool per block would hold "
                f"{_mib(mem['arena_separate_bytes'])} MiB)"
                + (f"; limit {_mib(limit)} MiB, {mem['replay_pieces']} replay(s) split" if limit else "")
                + (f"; OVER the limit by {last['over_limit_bytes']:,} bytes" if last.get("over_limit") else "")
            )
            if self.over_limit_steps:
                shown = ", ".join(map(str, self.over_limit_steps[:10])) + (", ..." if len(self.over_limit_steps) > 10
                                                                          else "")
                lines.append(f"over memory_limit: {len(self.over_limit_steps)} of {self.steps} step(s) (steps {shown}; "
                             f"StepStats.over_limit)")
            if len(self.peaks) > 1:
                lines.append(f"step peaks over {len(self.peaks)} steps: min {_mib(min(self.peaks))} MiB, "
                             f"max {_mib(max(self.peaks))} MiB")
            lines += ["", f"{'phase':<10}{'allocated MiB':>15}{'peak MiB':>10}{'alive at end MiB':>18}{'allocs':>9}"]
            for name, ph in mem["phases"].items():
                lines.append(f"{name:<10}{_mib(ph['allocated_bytes']):>15}{_mib(ph['peak_bytes']):>10}"
                             f"{_mib(ph['alive_bytes']):>18}{ph['allocations']:>9}")
        lines += [
            "",
            f"{'block':<24}{'ops':>6}{'saved':>7}{'kept MiB':>10}{'dropped MiB':>13}{'replayed MiB':>14}"
            f"{'ops replayed':>14}{'replay ms':>11}",
        ]
        for b in last["blocks"]:
            lines.append(
                f"{b['name'][:23]:<24}{b['ops_recorded']:>6}{b['saved_tensors']:>7}{_mib(b['kept_bytes']):>10}"
                f"{_mib(b['dropped_bytes']):>13}{_mib(b.get('replayed_bytes', 0)):>14}{b['ops_replayed']:>14}"
                f"{b['replay_ms']:>11.2f}"
            )
        if self.ops_replayed_by_name:
            top = sorted(self.ops_replayed_by_name.items(), key=lambda kv: -kv[1])[:8]
            lines += ["", "replayed ops: " + ", ".join(f"{k} ×{v}" for k, v in top)]
        return "\n".join(lines)

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Writes a PNG: the last step's memory timeline by phase (top) and per-block kept / dropped / replayed
        bytes (bottom). Needs matplotlib."""
        return plot_reports([self], path, title=title)


def plot_reports(reports: Sequence[StepReport], path: str | Path, title: str | None = None,
                 labels: Sequence[str] | None = None) -> Path:
    """One figure comparing reports (e.g. policy "none" and "full"): a timeline panel and a bar panel per report."""
    plt = pyplot("StepReport.plot")
    if not reports or any(r.last is None for r in reports):
        raise ConfigError("plot needs reports with at least one step")
    labels = list(labels) if labels else [f"policy {r.policy!r}" for r in reports]
    fig, axes = plt.subplots(2, len(reports), figsize=(7 * len(reports), 8), squeeze=False)
    ymax = max((max((p[1] for p in r.timeline.get("points", [])), default=0) for r in reports), default=0)
    for col, (rep, label) in enumerate(zip(reports, labels)):
        ax = axes[0][col]
        pts = rep.timeline.get("points", [])
        mem = rep.last.get("memory") or {}
        base = mem.get("baseline_bytes", 0)
        if pts:
            # Step-wise line, coloured by phase.
            for phase, color in _PHASE_COLORS.items():
                xs, ys = [], []
                for t, b, ph in pts:
                    if ph == phase:
                        xs.append(t / 1e6)
                        ys.append((b + base) / 2**20)
                    elif xs:
                        xs.append(float("nan"))
                        ys.append(float("nan"))
                ax.plot(xs, ys, drawstyle="steps-post", color=color, label=phase, linewidth=1.2)
            for kind, block, b0, b1 in rep.timeline.get("spans", []):
                if kind == "replay":
                    ax.axvspan(b0 / 1e6, b1 / 1e6, color=_PHASE_COLORS["replay"], alpha=0.12, linewidth=0)
            ax.axhline(base / 2**20, color="gray", linestyle=":", linewidth=1, label="baseline")
            if mem.get("memory_limit"):
                ax.axhline(mem["memory_limit"] / 2**20, color="black", linestyle="--", linewidth=1, label="limit")
            ax.set_ylim(0, (ymax + base) / 2**20 * 1.08 + 1e-9)
        else:
            ax.text(0.5, 0.5, "no timeline recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("time in step (ms)")
        ax.set_ylabel("tensor memory (MiB)")
        peak = mem.get("peak_bytes", 0)
        ax.set_title(f"{label}: step peak {peak / 2**20:.1f} MiB")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)

        ax = axes[1][col]
        blocks = rep.last["blocks"]
        names = [b["name"].split(".")[-1] if b["name"] else "?" for b in blocks]
        xs = range(len(blocks))
        w = 0.28
        ax.bar([x - w for x in xs], [b["kept_bytes"] / 2**20 for b in blocks], w, label="kept", color="#1f77b4")
        ax.bar(list(xs), [b["dropped_bytes"] / 2**20 for b in blocks], w, label="dropped", color="#ff7f0e")
        ax.bar([x + w for x in xs], [b.get("replayed_bytes", 0) / 2**20 for b in blocks], w, label="replayed",
               color="#2ca02c")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_xlabel("block call")
        ax.set_ylabel("MiB")
        ax.set_title(f"{label}: per block call")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(plt, fig, path, "StepReport.plot")
