# tapesac.bench.long — the long mode (--train-steps N): training on real text under each tool, side by side.
#
# Contract:
# - `run_long(args, tapesac, progress, factories=LONG_VARIANT_FACTORIES) -> dict`: N AdamW steps of a small Qwen3 on
#   Austen (tapesac.data.AustenData) per run: no checkpointing, torch.utils.checkpoint per layer, tapesac auto under
#   one memory limit. Every run has its own deep copy of one initial model and optimizer, sees the same batches, and
#   the runs take turns step by step (rotating order), so their step times are paired.
# - Reported per run: the loss curve and whether it is bitwise equal to the first run's, step times (total, median,
#   statistics, paired ratios), validation loss on held-out text before and after, and for tapesac the replay time
#   and its own step peaks (steps over the limit counted when the limit is in bytes).
# - The limit: --memory-limit when given; on CUDA "90%"; on CPU the step peak halfway between full checkpointing's
#   and no checkpointing's, measured on one batch (`long_limit`).
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import harness
from .measure import PeakMeter
from .run import Progress
from .sizes import SIZES, MiB, Size, build_model, describe_model
from .variants import CKPT, NOCKPT, checkpointed_blocks


@dataclass
class Trainer:
    """One training run of the long mode: its own model copy and optimizer, and a step under some tool."""

    name: str
    label: str
    model: nn.Module
    step: Callable[[torch.Tensor], torch.Tensor]
    note: str = ""
    sac: Any = None


def _trainer(name: str, label: str, model: nn.Module, region: Callable[[], Any], sac: Any = None) -> Trainer:
    """A run whose step is forward + backward of `model` on the batch inside `region()`."""
    def step(ids: torch.Tensor) -> torch.Tensor:
        with region():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss

    return Trainer(name, label, model, step, sac=sac)


def _long_nockpt(ctx: dict[str, Any]) -> list[Trainer]:
    return [_trainer(NOCKPT, "no checkpointing", copy.deepcopy(ctx["base"]), contextlib.nullcontext)]


def _long_ckpt(ctx: dict[str, Any]) -> list[Trainer]:
    model = copy.deepcopy(ctx["base"])
    return [_trainer(CKPT, "torch.utils.checkpoint per layer", model,
                     lambda: checkpointed_blocks(list(model.model.layers)))]


def _long_tapesac(ctx: dict[str, Any]) -> list[Trainer]:
    """tapesac policy="auto" at the long mode's memory limit."""
    model = copy.deepcopy(ctx["base"])
    lim = ctx["memory_limit"]
    sac = ctx["tapesac"].TapeSAC(model, blocks="model.layers.*", policy="auto", memory_limit=lim)
    shown = f"{lim / MiB:.1f} MiB" if isinstance(lim, int) else repr(lim)
    return [_trainer("tapesac_auto", f"tapesac auto, memory_limit={shown}", model, sac.step, sac=sac)]


# The long mode's runs, in order (append a factory to add one). Each: dict(base, tapesac, memory_limit) -> Trainers.
LONG_VARIANT_FACTORIES: list[Callable[[dict[str, Any]], list[Trainer]]] = [_long_nockpt, _long_ckpt, _long_tapesac]


def long_limit(args: argparse.Namespace, base: nn.Module, data: Any, size: Size) -> tuple[Any, str]:
    """tapesac auto's memory_limit in the long mode, and how it was chosen.

    --memory-limit when given. Otherwise on CUDA "90%" of device memory (where no checkpointing does not fit), and
    on CPU, where nothing runs out of memory, the step peak halfway between full checkpointing's and no
    checkpointing's, measured on the first batch (a limit under which full checkpointing is the conventional choice
    and auto can spend the slack on keeping tensors)."""
    if args.memory_limit is not None:
        return args.memory_limit, "--memory-limit"
    if size.device.startswith("cuda"):
        return "90%", "default on CUDA"
    model = copy.deepcopy(base)
    ids = data.val_batches(1)[0]
    meter = PeakMeter(cuda=False)

    def plain() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def ckpt() -> None:
        with checkpointed_blocks(list(model.model.layers)):
            model(input_ids=ids, labels=ids).loss.backward()

    peaks = {}
    for name, fn in (("nockpt", plain), ("ckpt", ckpt)):
        peaks[name] = meter.step_peak(fn, model)[0]
        model.zero_grad(set_to_none=True)
    limit = peaks["ckpt"] + (peaks["nockpt"] - peaks["ckpt"]) // 2
    return limit, (f"halfway between ckpt's step peak ({peaks['ckpt'] / MiB:.1f} MiB) and nockpt's "
                   f"({peaks['nockpt'] / MiB:.1f} MiB) on one batch, measured with {meter.method.split(' (')[0]}")


@dataclass
class _Curves:
    """What the interleaved training loop records, per run name."""

    losses: dict[str, list[float]]
    times: dict[str, list[float]]
    replay: dict[str, list[float]]
    step_peaks: dict[str, list[int]]


def _train(trainers: list[Trainer], data: Any, args: argparse.Namespace, progress: Progress) -> _Curves:
    """args.train_steps steps of every run on the same batches, one step each in turn (the order rotates)."""
    opts = {t.name: torch.optim.AdamW(t.model.parameters(), lr=args.lr) for t in trainers}
    c = _Curves(losses={t.name: [] for t in trainers}, times={t.name: [] for t in trainers},
                replay={t.name: [] for t in trainers if t.sac is not None},
                step_peaks={t.name: [] for t in trainers if t.sac is not None})
    for s in range(args.train_steps):
        ids = data.sample()
        k = s % len(trainers)
        for t in trainers[k:] + trainers[:k]:
            torch.manual_seed(args.seed + s)
            t0 = time.perf_counter()
            loss = t.step(ids)
            opts[t.name].step()
            opts[t.name].zero_grad(set_to_none=True)
            c.times[t.name].append(time.perf_counter() - t0)
            c.losses[t.name].append(loss.item())
            if t.sac is not None:
                c.replay[t.name].append(t.sac.last_step.replay_ms)
                c.step_peaks[t.name].append(int(t.sac.last_step.memory.peak_bytes))
        if s % 5 == 0 or s + 1 == args.train_steps:
            progress(f"train: step {s + 1}/{args.train_steps}, loss " +
                     ", ".join(f"{n} {v[-1]:.3f}" for n, v in c.losses.items()))
    return c


def run_long(args: argparse.Namespace, tapesac: Any, progress: Progress,
             factories: Sequence[Callable[[dict[str, Any]], list[Trainer]]] | None = None) -> dict[str, Any]:
    """--train-steps N: N AdamW steps on Austen, every run on the same batches, steps interleaved (rotating order).
    `factories`: the runs (default LONG_VARIANT_FACTORIES)."""
    from ..data import AustenData

    size = SIZES[args.train_size]
    data = AustenData(seq_len=size.seq, batch_size=size.batch, seed=args.seed)
    base = build_model("qwen3", size, seed=args.seed)
    limit, limit_note = long_limit(args, base, data, size)
    ctx = {"base": base, "tapesac": tapesac, "memory_limit": limit}
    trainers = [t for f in (LONG_VARIANT_FACTORIES if factories is None else factories) for t in f(ctx)]
    if args.train_variants:
        keep = set(args.train_variants.split(","))
        trainers = [t for t in trainers if t.name in keep or t.name.split("_")[0] in keep]
    val = data.val_batches(args.val_batches)

    def val_loss(model: nn.Module) -> float:
        with torch.no_grad():
            return statistics.fmean(model(input_ids=b, labels=b).loss.item() for b in val)

    val0 = val_loss(base)
    t_start = time.perf_counter()
    c = _train(trainers, data, args, progress)
    elapsed = time.perf_counter() - t_start
    ref = trainers[0].name
    runs = {}
    for t in trainers:
        times = c.times[t.name]
        runs[t.name] = {
            "label": t.label, "note": t.note, "total_s": sum(times),
            "median_step_ms": statistics.median(times) * 1e3,
            "step_ms": harness.stats(times, scale=1e3),
            "loss": c.losses[t.name], "step_s": times,
            "val_loss_start": val0, "val_loss_end": val_loss(t.model),
            "losses_bitwise_equal_to_" + ref: c.losses[t.name] == c.losses[ref],
        }
        if t.sac is not None:
            peaks = c.step_peaks[t.name]
            runs[t.name]["median_replay_ms"] = statistics.median(c.replay[t.name])
            if peaks:  # tapesac's own step peak (MemoryStats.peak_bytes: baseline included)
                runs[t.name]["max_step_peak_bytes"] = max(peaks)
                if isinstance(limit, int):
                    runs[t.name]["steps_over_limit"] = sum(p > limit for p in peaks)
            t.sac.close()
    for t in trainers:
        r = runs[t.name]
        r["total_ratio_nockpt"] = r["total_s"] / runs[ref]["total_s"] if ref == NOCKPT else None
        r["total_ratio_ckpt"] = r["total_s"] / runs[CKPT]["total_s"] if CKPT in runs else None
        # Paired per step (the runs took turns on the same batch): robust to load that comes and goes.
        for key, other in (("step_ratio_nockpt_paired", NOCKPT), ("step_ratio_ckpt_paired", CKPT)):
            if other in runs:
                r[key] = harness.paired_ratio(c.times[t.name], c.times[other])
    return {"steps": args.train_steps, "model": describe_model("qwen3", base), "size": args.train_size,
            "memory_limit": limit, "memory_limit_source": limit_note,
            "batch": size.batch, "seq": size.seq, "lr": args.lr, "optimizer": "AdamW", "corpus": data.describe(),
            "val_batches": args.val_batches, "wall_clock_s": elapsed, "runs": runs}
