"""``tapesac frontier``: the memory/time plane of one model, measured side by side and planned.

Runs the benchmark suite (tapesac.bench) on one model for no checkpointing, ``torch.utils.checkpoint``, PyTorch
SAC (torchtitan-style policy), tapesac ``full`` and tapesac ``auto`` at several limits (each validated against
no checkpointing, then timed; progress on stderr), then the planner's frontier for the same model and batch shape
(``TapeSAC.frontier()``: the best plan's predicted peak and replay time at limits from the smallest feasible peak
to keeping everything). Prints one table (every peak in it is the step peak, the one definition tapesac uses) and
writes one PNG: x = step peak, y = recompute time per step (tapesac: measured replay time; the PyTorch tools: step
time minus no checkpointing's, as the suite estimates it; the frontier: predicted replay time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["add_arguments", "run", "main"]

DESCRIPTION = __doc__


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from .bench.sizes import ARCHS, SIZES

    ap.add_argument("--size", default="small", choices=list(SIZES))
    ap.add_argument("--model", default="qwen3", choices=list(ARCHS))
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per variant (default 8)")
    ap.add_argument("--points", type=int, default=12, help="points on the planner's frontier (default 12)")
    ap.add_argument("--plot", default="frontier.png", help="PNG to write (default frontier.png)")
    ap.add_argument("--json", default=None, help="write the measured variants and the frontier as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    from . import bench
    from .bench.cli import build_parser, run_suite
    from .bench.measure import PEAK_DEFINITION
    from .core import TapeSAC
    from .frontier import Frontier
    from .progress import Progress

    from .cli_args import at_least, writable

    writable("--plot", args.plot, figure=True)
    writable("--json", args.json)
    at_least("--rounds", args.rounds, 1)
    at_least("--points", args.points, 2)
    variants = "ckpt,torch_sac,tapesac_full,tapesac_auto_0.25,tapesac_auto_0.5,tapesac_auto_0.75"
    bench_args = build_parser().parse_args(
        ["--size", args.size, "--models", args.model, "--variants", variants, "--rounds", str(args.rounds),
         "--no-compile", "--auto-fractions", "0.25,0.5,0.75"] + (["--quiet"] if args.quiet else []))
    rc, report = run_suite(bench_args, echo=False)
    if not report.get("workloads"):
        print("tapesac frontier: the benchmark run failed; see its output above", file=sys.stderr)
        return rc or 1
    work = report["workloads"][0]
    res = work["variants"]
    size = bench.SIZES[args.size]
    model = bench.build_model(args.model, size, seed=0)
    lo, hi = res["ckpt"]["peak_bytes"], res["nockpt"]["peak_bytes"]  # step peaks
    if size.device == "cpu":
        # The same thread count as the benchmark's CPU default: the op times the frontier is priced with must
        # come from the configuration the measured points ran in.
        torch.set_num_threads(1)
    sac = TapeSAC(model, blocks="model.layers.*", memory_limit=int((lo + hi) / 2))
    ids = torch.randint(0, model.config.vocab_size, (size.batch, size.seq), device=size.device)
    progress = Progress(enabled=not args.quiet, label="frontier")
    warm = 5
    for i in range(warm):  # op costs are per-op medians over calls: a few warm steps outweigh the cold first one
        progress(f"planner: step {i + 1}/{warm} under tapesac auto", force=i == 0)
        with sac.step():
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    progress.done()
    frontier = sac.frontier(points=args.points)
    sac.close()
    markers = {"nockpt": "o", "ckpt": "^", "torch_sac": "v", "tapesac_full": "D"}
    measured = []
    for name, v in res.items():
        if v.get("status") != "ok" or v.get("peak_bytes") is None:
            continue
        y = 0.0 if name == "nockpt" else v.get("recompute_ms")
        measured.append({"label": v["label"], "peak_bytes": v["peak_bytes"], "replay_ms": y,
                         "step_ms": (v.get("step_ms") or {}).get("median") if isinstance(v.get("step_ms"), dict)
                         else v.get("step_ms"), "marker": markers.get(name, "s")})
    shown = Frontier(planned=frontier.planned, measured=measured, limit_bytes=None)
    print(f"{work['name']}: {work['description']}")
    print(f"(peak: {PEAK_DEFINITION})")
    print(shown.pretty())
    for name, v in res.items():
        if v.get("status") != "ok":
            print(f"not measured: {name}: {v.get('status')}: {v.get('reason', '')}")
    path = shown.plot(args.plot, title=f"{work['name']}: memory / time plane (CPU)" if size.device == "cpu"
                      else f"{work['name']}: memory / time plane")
    print(f"plot: {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": report.get("environment"), "workload": work,
                                               "frontier": shown.to_dict()}, indent=2, default=str) + "\n")
        print(f"json: {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``tapesac frontier argv...`` (one-line errors; see tapesac.cli)."""
    from .cli import run_module

    return run_module("frontier", argv)
