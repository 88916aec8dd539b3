# tapesac.bench.cli — the command line of the suite: `tapesac bench ...` and `tapesac.bench.main(argv)`.
#
# Contract:
# - `add_arguments(parser)` and `run(args) -> int` are the `bench` command of tapesac.cli; `main(argv) -> int` runs
#   `tapesac bench argv...` through it (one-line errors). `run_suite(args, echo=True) -> (status, report)` is the
#   work: the step suite on every (--size, --models) workload and, with --train-steps, the long mode; with `echo` it
#   prints a table per workload and a summary line (progress goes to stderr unless --quiet); it writes --json
#   (schema_version, environment, args, memory method, workloads, long, elapsed) and --plot / --train-plot.
#   `--from-json PATH` runs nothing: it reprints the tables and redraws the plots of a saved run.
# - Exit status 1 when a required variant is invalid or crashed, or --variants names no variant of the suite (checked
#   before any workload is built, against variants.variant_names()).
# - The suite's factories are read from the package (`tapesac.bench.VARIANT_FACTORIES`,
#   `tapesac.bench.LONG_VARIANT_FACTORIES`) when main runs, so a caller that replaces them runs its own suite.
# - CPU runs use one intra-op thread unless --threads says otherwise; run_suite() restores torch's thread count and
#   deterministic-algorithms flag when it returns (tests call it in-process). HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE
#   and CUBLAS_WORKSPACE_CONFIG are set (when unset) on the first run, not at import.
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from . import harness
from .long import run_long
from .measure import PEAK_DEFINITION, PeakMeter, jsonable
from .render import format_long, format_table, plot_long, plot_plane
from ..progress import Progress
from .run import bench_workload
from .sizes import ARCHS, SIZES, Workload, build_model, describe_model
from .variants import VARIANT_FACTORIES, variant_names

SCHEMA_VERSION = 1


DESCRIPTION = ("One training step of HF Qwen3 / Qwen3-MoE / Llama under no checkpointing, torch.utils.checkpoint, "
               "PyTorch SAC, torch.compile's memory budget and tapesac, side by side.")


def build_parser() -> argparse.ArgumentParser:
    """The options of `tapesac bench` (see --help)."""
    p = argparse.ArgumentParser(prog="tapesac bench", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(ARCHS), help=f"comma-separated: {','.join(ARCHS)} (default all)")
    p.add_argument("--size", default=None,
                   help=f"comma-separated sizes: {','.join(SIZES)} (default: gpu1b with CUDA, else small,medium)")
    p.add_argument("--batch", type=int, default=None, help="override the size's batch")
    p.add_argument("--seq", type=int, default=None, help="override the size's sequence length")
    p.add_argument("--variants", default=None, help="comma-separated variant names to run (nockpt always runs)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds after validation (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads; 0 keeps torch's default (default: 1 on CPU, where a busy core stalls "
                        "every OpenMP barrier of a 2-thread step; torch's default with CUDA)")
    p.add_argument("--seed", type=int, default=0, help="weights, batch and step seed (default 0)")
    p.add_argument("--compile", action="store_true", help="run torch.compile on CPU too (slow: C++ kernels)")
    p.add_argument("--no-compile", action="store_true", help="never run torch.compile")
    p.add_argument("--compile-budgets", default="0.5", help="activation_memory_budget values (default 0.5)")
    p.add_argument("--auto-fractions", default="0.25,0.5,0.75",
                   help="tapesac auto limits as fractions from ckpt's peak to nockpt's (default 0.25,0.5,0.75)")
    p.add_argument("--smoke", action="store_true", help="tiny models, 3 rounds: well under a minute on CPU")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number and the environment as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the memory/time plane")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="run nothing: print the tables of a --json file and draw --plot / --train-plot from it")
    g = p.add_argument_group("long mode")
    g.add_argument("--train-steps", type=int, default=0,
                   help="train N steps on Austen (small Qwen3), ckpt vs tapesac; skips the step suite unless "
                        "--size is given")
    g.add_argument("--train-size", default="small", help="model size of the long mode (default small)")
    g.add_argument("--train-variants", default=None, help="runs of the long mode (default nockpt,ckpt,tapesac)")
    g.add_argument("--train-plot", default=None, metavar="PNG", help="loss curves and cumulative time")
    g.add_argument("--memory-limit", default=None,
                   help="tapesac auto's limit in the long mode (bytes, '2GiB', '90%%'; default: 90%% on CUDA; on CPU "
                        "halfway between full checkpointing's measured peak and no checkpointing's)")
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the long mode (default 1e-3)")
    g.add_argument("--val-batches", type=int, default=8, help="validation batches (persuasion) (default 8)")


def main(argv: Sequence[str] | None = None) -> int:
    """``tapesac bench argv...`` (one-line errors; see tapesac.cli)."""
    from ..cli import run_module

    return run_module("bench", argv)


def run(args: argparse.Namespace) -> int:
    return run_suite(args)[0]


def run_suite(args: argparse.Namespace, echo: bool = True) -> tuple[int, dict[str, Any]]:
    """Runs the suite (and the long mode): (exit status, the report the JSON holds). Restores torch's thread count
    and determinism flag afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    log = logging.getLogger("tapesac")
    log.addFilter(_expected_conflicts)
    try:
        return _main(args, echo)
    finally:
        log.removeFilter(_expected_conflicts)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _expected_conflicts(record: logging.LogRecord) -> bool:
    """The suite runs every tool on one model by design: several TapeSACs on it, and the other tools' steps outside
    theirs. Those two conflict warnings (conflicts.py) say nothing here; every other warning passes."""
    return getattr(record, "tapesac_key", None) not in ("second", "outside")


def _replot(args: argparse.Namespace) -> int:
    """--from-json: the tables and plots of a saved run."""
    report = json.loads(Path(args.from_json).read_text())
    for w in report.get("workloads", []):
        print(format_table(w))
    if report.get("long"):
        print(format_long(report["long"]))
    if args.plot and report.get("workloads"):
        plot_plane(report, args.plot)
        print(f"wrote {args.plot}")
    if args.train_plot and report.get("long"):
        plot_long(report["long"], args.train_plot)
        print(f"wrote {args.train_plot}")
    return 0


def _package() -> Any:
    """The tapesac.bench package as it is now (its factory lists may have been replaced by the caller)."""
    from .. import bench

    return bench


def _resolve(args: argparse.Namespace, cuda: bool) -> tuple[list[str], list[str]]:
    """Fills the defaults that depend on the machine (threads, rounds under --smoke, sizes) and returns the checked
    (sizes, architectures); an unknown or unusable name raises SystemExit with the accepted ones."""
    if args.threads is None:
        args.threads = 0 if cuda else 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.rounds, args.warmup = min(args.rounds, 3), min(args.warmup, 1)
    if args.size is None:
        args.size = "smoke" if args.smoke else ("gpu1b" if cuda else ("" if args.train_steps else "small,medium"))
    sizes = [s.strip() for s in args.size.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"unknown --size {s!r}; expected one of {list(SIZES)}")
        if SIZES[s].device == "cuda" and not cuda:
            raise SystemExit(f"--size {s} needs CUDA (torch.cuda.is_available() is False); use small or medium")
    archs = [a.strip() for a in args.models.split(",") if a.strip()]
    for a in archs:
        if a not in ARCHS:
            raise SystemExit(f"unknown model {a!r} in --models; expected some of {list(ARCHS)}")
    return sizes, archs


def _workload(s: str, arch: str, args: argparse.Namespace) -> Workload:
    """Size `s` (with --batch / --seq applied) of `arch`, and its batch of random token ids."""
    base_size = SIZES[s]
    size = dataclasses.replace(base_size, batch=args.batch or base_size.batch, seq=args.seq or base_size.seq)
    model = build_model(arch, size, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (size.batch, size.seq), generator=gen)  # [batch, seq]
    return Workload(name=f"{s}/{arch}", arch=arch, size_name=s, size=size, model=model,
                    pristine=copy.deepcopy(model), ids=ids.to(size.device), description=describe_model(arch, model))


def _unknown_variants(args: argparse.Namespace) -> list[str]:
    """The --variants names the default suite cannot make under these arguments (sorted; [] when --variants is not
    given, or the caller replaced the factory list: then each workload's record reports them after its run)."""
    if not args.variants or _package().VARIANT_FACTORIES is not VARIANT_FACTORIES:
        return []
    return sorted(set(args.variants.split(",")) - variant_names(args))


def _failures(w: dict[str, Any]) -> list[str]:
    """What in a workload record fails the run: required variants invalid or crashed, unknown --variants names."""
    bad = [f"{w['name']}/{name}: {r['status']}: {r.get('reason', '')}" for name, r in w["variants"].items()
           if r["status"] in ("invalid", "error") and not r.get("optional")]
    if w.get("unknown_variants"):
        bad.append(f"{w['name']}: --variants names no variant of the suite: {w['unknown_variants']} "
                   f"(known: {w['known_variants']})")
    return bad


def _main(args: argparse.Namespace, echo: bool) -> tuple[int, dict[str, Any]]:
    if args.from_json:
        return _replot(args), json.loads(Path(args.from_json).read_text())
    say = print if echo else (lambda *a, **k: None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # cuBLAS is deterministic under use_deterministic_algorithms only with a fixed workspace, set before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import tapesac

    cuda = torch.cuda.is_available()
    sizes, archs = _resolve(args, cuda)
    progress = Progress(enabled=not args.quiet)
    env = harness.environment()
    meter = PeakMeter(cuda and any(SIZES[s].device == "cuda" for s in sizes))
    say(f"tapesac bench: torch {env['torch']}, transformers {env['transformers']}, {env['device']}, "
        f"{env['threads']} threads, {harness.describe_provenance(env)}")
    if sizes:
        say(f"{args.rounds} timed rounds after {args.warmup} warm-up round(s), order rotating; peak memory: "
            f"{meter.method}")
    report: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "benchmark": "bench_step", "environment": env,
                              "args": vars(args), "memory_method": meter.method, "workloads": []}
    bad: list[str] = []
    unknown = _unknown_variants(args)
    if unknown:
        # Before any model is built: a misspelt name must not cost the whole suite's run first.
        known = sorted(variant_names(args))
        report.update(unknown_variants=unknown, known_variants=known)
        bad.append(f"--variants names no variant of the suite: {unknown} (known with these arguments: {known}; "
                   f"tapesac_auto_<fraction> follows --auto-fractions, compile_b<budget> --compile-budgets)")
        sizes = archs = []
        args = argparse.Namespace(**{**vars(args), "train_steps": 0})  # nothing runs: the long mode neither
    t_all = time.perf_counter()
    for s in sizes:
        for arch in archs:
            progress(f"{s}/{arch}: building", force=True)
            work = _workload(s, arch, args)
            w = bench_workload(work, args, tapesac, meter, progress, _package().VARIANT_FACTORIES)
            progress.done()
            say(format_table(w), flush=True)
            report["workloads"].append(w)
            bad += _failures(w)
            del work
            gc.collect()
    if report["workloads"]:
        say(f"\n(step ms: median over rounds, IQR; x nockpt / x ckpt: median of per-round ratios to no checkpointing "
            f"/ torch.utils.checkpoint; peak: {PEAK_DEFINITION}; recompute: tapesac measured replay time, 'est' = "
            f"median step - median no-checkpoint step)")
    if args.train_steps:
        progress("long mode: starting", force=True)
        report["long"] = run_long(args, tapesac, progress, _package().LONG_VARIANT_FACTORIES)
        progress.done()
        say(format_long(report["long"]))
        if args.train_plot:
            plot_long(report["long"], args.train_plot)
            say(f"wrote {args.train_plot}")
    report["elapsed_s"] = time.perf_counter() - t_all
    say(f"\n{report['elapsed_s']:.1f} s")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(jsonable(report), indent=1) + "\n")
        say(f"wrote {path}")
    if args.plot and report["workloads"]:
        plot_plane(report, args.plot)
        say(f"wrote {args.plot}")
    for b in bad:
        print(f"FAILED {b}", file=sys.stderr)
    return (1 if bad else 0), report
