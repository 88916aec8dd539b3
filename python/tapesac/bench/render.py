# tapesac.bench.render — the suite's tables and plots, drawn from its JSON records only.
#
# Contract:
# - `format_table(workload_record) -> str`: one row per variant (step time with IQR, time ratios, peak MiB, peak
#   ratios, recompute time, validation method); a variant that is not ok prints its status and reason instead.
# - `format_long(long_record) -> str`: the long mode's table (totals, ratios, losses, whether each curve is
#   bitwise equal to the first run's, notes, tapesac's step peaks and the limit with its source).
# - `plot_plane(report, path)`: the memory/time plane, one panel per workload; `plot_long(long, path)`: loss curves
#   and cumulative step time. Both write a PNG with matplotlib's Agg backend (imported on call).
# - Everything reads only the dicts `bench_workload`, `run_long` and main() write, so `--from-json` redraws a
#   saved run exactly.
from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from ..plotting import pyplot
from .sizes import MiB


def _fmt(x: Any, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(w: dict[str, Any]) -> str:
    """The table of one workload record (see bench_workload)."""
    lines = [f"\n{w['name']}: {w['description']}; batch {w['batch']} x seq {w['seq']}, {w['dtype']}, {w['device']}"]
    head = (f"  {'variant':<24}{'step ms':>9}{'IQR':>7}{'x nockpt':>9}{'x ckpt':>8}{'peak MiB':>10}{'x nockpt':>9}"
            f"{'x ckpt':>8}{'recompute ms':>14}  valid")
    lines.append(head)
    for name, r in w["variants"].items():
        if r["status"] != "ok":
            lines.append(f"  {name:<24}{r['status'].upper()}: {r.get('reason', '')}")
            continue
        t = r.get("step_ms", {})
        rec = r.get("recompute_ms")
        est = " est" if r.get("recompute_method", "").startswith("estimate") else ""
        rec_s = "-" if rec is None else f"{rec:.1f}{est}"
        val = r.get("validation", {})
        lines.append(
            f"  {name:<24}{_fmt(t.get('median'), '9.1f', '        -')}{_fmt(t.get('iqr'), '7.1f', '      -')}"
            f"{_fmt(r.get('time_ratio_nockpt'), '9.3f', '        -')}"
            f"{_fmt(r.get('time_ratio_ckpt'), '8.3f', '       -')}"
            f"{r['peak_bytes'] / MiB:10.1f}{_fmt(r.get('peak_ratio_nockpt'), '9.3f', '        -')}"
            f"{_fmt(r.get('peak_ratio_ckpt'), '8.3f', '       -')}{rec_s:>14}  {val.get('method', '')}"
            + ("" if r.get("within_limit", True) else "  PEAK OVER memory_limit")
        )
    return "\n".join(lines)


def plot_plane(report: dict[str, Any], path: str) -> None:
    """The memory/time plane: one panel per workload, x = step time / nockpt, y = peak MiB, every timed variant.

    Each variant has one marker (shape by tool: circle baseline, square PyTorch, diamond compile, triangle
    tapesac) and one colour in every panel; one legend names them (labels next to points overlap too often)."""
    plt = pyplot("the benchmark's plots")

    works = report["workloads"]
    n = max(1, len(works))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols + 1.8, 4.2 * rows), squeeze=False)
    shapes = {"baseline": "o", "pytorch": "s", "compile": "D", "tapesac": "^"}
    names = list(dict.fromkeys(name for w in works for name, r in w["variants"].items()
                               if r["status"] == "ok" and "time_ratio_nockpt" in r))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    style = {name: (cmap(i % cmap.N),) for i, name in enumerate(names)}
    handles: dict[str, Any] = {}
    for ax, w in zip(axes.flat, works):
        for name, r in w["variants"].items():
            if name not in style or r["status"] != "ok" or "time_ratio_nockpt" not in r:
                continue
            x, y = r["time_ratio_nockpt"], r["peak_bytes"] / MiB
            h = ax.scatter([x], [y], color=style[name][0], marker=shapes.get(r["kind"], "o"), s=46, zorder=3,
                           edgecolors="black", linewidths=0.4)
            handles.setdefault(name, h)
        ax.set_title(f"{w['name']} (b{w['batch']}×s{w['seq']})", fontsize=9)
        ax.set_xlabel("step time / no checkpointing (median of paired rounds)", fontsize=8)
        ax.set_ylabel("step peak (MiB)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(works):]:
        ax.axis("off")
    fig.legend([handles[nm] for nm in names], names, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(f"tapesac bench — {report['environment']['device']}; peak: {report['memory_method'].split(' (')[0]}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 1.7 / (5.0 * cols + 1.8), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_long(long: dict[str, Any], path: str) -> None:
    """Two panels: train loss (mean of the last 10 steps) and cumulative step time, one line per run."""
    plt = pyplot("the benchmark's plots")

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in long["runs"].items():
        loss = r["loss"]
        k = 10
        smooth = [statistics.fmean(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
        a.plot(range(1, len(loss) + 1), smooth, label=f"{name} (val {r['val_loss_end']:.3f})", lw=1.2)
        cum = list(itertools.accumulate(r["step_s"]))
        b.plot(range(1, len(cum) + 1), cum, label=f"{name}: {r['total_s']:.0f} s", lw=1.2)
    a.set_xlabel("step")
    a.set_ylabel("train loss (mean of last 10 steps)")
    a.legend(fontsize=8)
    a.grid(True, alpha=0.3)
    b.set_xlabel("step")
    b.set_ylabel("cumulative step time (s)")
    b.legend(fontsize=8)
    b.grid(True, alpha=0.3)
    fig.suptitle(f"{long['steps']} steps on Austen — {long['model']}, batch {long['batch']}×seq {long['seq']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)




def format_long(long: dict[str, Any]) -> str:
    """The table of the long mode's record (see run_long)."""
    lines = [f"\nlong mode: {long['steps']} AdamW steps on {long['corpus']}", f"  {long['model']}, batch "
             f"{long['batch']} x seq {long['seq']}; steps interleaved (rotating order), same batches",
             f"  {'run':<16}{'total s':>9}{'x nockpt':>10}{'x ckpt':>8}{'median ms':>11}{'replay ms':>11}"
             f"{'loss 1':>8}{'loss N':>8}{'val end':>9}  curve"]
    for name, r in long["runs"].items():
        same = [v for k, v in r.items() if k.startswith("losses_bitwise_equal_to_")][0]
        lines.append(
            f"  {name:<16}{r['total_s']:9.1f}{_fmt(r['total_ratio_nockpt'], '10.3f', '         -')}"
            f"{_fmt(r['total_ratio_ckpt'], '8.3f', '       -')}{r['median_step_ms']:11.1f}"
            f"{_fmt(r.get('median_replay_ms'), '11.1f', '          -')}{r['loss'][0]:8.3f}{r['loss'][-1]:8.3f}"
            f"{r['val_loss_end']:9.3f}  {'identical' if same else 'DIFFERS'}")
        if r["note"]:
            lines.append(f"    note: {r['note']}")
        if "max_step_peak_bytes" in r:
            over = r.get("steps_over_limit")
            peak = r["max_step_peak_bytes"] / MiB
            lines.append(f"    tapesac step peak (telemetry, baseline included): max {peak:.1f} MiB"
                         + (f", {over} step(s) over the limit" if over is not None else ""))
    lim = long.get("memory_limit")
    if lim is not None:
        shown = f"{lim / MiB:.1f} MiB" if isinstance(lim, int) else repr(lim)
        lines.append(f"  tapesac auto memory_limit {shown}: {long.get('memory_limit_source', '')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------
