# tapesac.bench.measure — what one variant's step is measured and validated with.
#
# Contract:
# - `PeakMeter(cuda).measure(fn) -> int`: peak bytes above the level at entry of one call of `fn`, measured by
#   tapesac.MemoryMeter: on CUDA torch.cuda.max_memory_allocated after reset_peak_memory_stats, on CPU the counting
#   CPU allocator. `method` says which, for the printout and the JSON. `step_peak(fn, model)` adds the level at
#   entry: the step peak (PEAK_DEFINITION, the one definition of "peak" that tapesac prints).
# - `run_once(v, work, seed) -> Snapshot`: one step of a variant from `seed` (under deterministic algorithms on
#   CUDA), its loss and cloned gradients; the gradients are zeroed afterwards (set_to_none).
# - `compare(got, want, rtol) -> (valid, detail, max relative diff)`: loss and every parameter gradient; rtol None
#   means bitwise. COMPILE_RTOL (torch.compile, per dtype) and DEVICE_RTOL (a device whose reference is not bitwise
#   reproducible) are the only tolerances, each with its reason below.
# - `telemetry_memory`, `graph_stats`, `graph_launch_times`: the JSON forms of what a tapesac step reports about
#   its memory and its CUDA-graph launches; `jsonable(x)`: dicts, lists, numbers, strings, dataclasses as dicts,
#   anything else as its repr.
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..memory import MemoryMeter
from .sizes import Workload, model_bytes
from .variants import Variant

# torch.compile reorders and fuses float reductions (RMSNorm means, softmax, matmul epilogues), so its loss and
# gradients differ from eager in the last bits: compare with a relative tolerance on each tensor's scale. fp32 on
# CPU measured 1.4e-6 to 3.7e-6 (2026-11-29 results); bf16 keeps 8 mantissa bits (one rounding is 4e-3), and
# reordered sums over thousands of terms compound it.
COMPILE_RTOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}
# CUDA kernels (SDPA backward, cuBLAS split-K) may reorder reductions between runs even for the same inputs; when
# the no-checkpoint reference is not bitwise reproducible on the device, exact variants get this tolerance.
DEVICE_RTOL = 1e-2


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# The one definition of a step's peak memory, wherever tapesac prints one: StepStats.memory.peak_bytes, StepReport,
# the trainer integrations' tapesac/peak_mib, `tapesac bench` and `tapesac frontier`.
PEAK_DEFINITION = ("step peak = the most tensor memory alive at once in the step, counting what was alive when it "
                   "started (CPU: the model's parameters and buffers; CUDA: all allocated memory)")


class PeakMeter:
    """Peak bytes above the level at entry of one call, by tapesac.MemoryMeter on the workload's device (CUDA: the
    caching allocator's max_memory_allocated; CPU: the counting allocator). `method` says which. `step_peak` adds
    the level at entry (PEAK_DEFINITION)."""

    def __init__(self, cuda: bool) -> None:
        self.device = "cuda" if cuda else "cpu"
        if cuda:
            self.method = "torch.cuda.max_memory_allocated (step peak: memory_allocated at entry + the peak above it)"
        else:
            self.method = ("tapesac.MemoryMeter (counting CPU allocator; step peak: the model's parameters and buffers "
                           "+ the peak above the level at entry)")

    def measure(self, fn: Callable[[], Any]) -> int:
        """Peak bytes above the level at entry of `fn()`."""
        with MemoryMeter(self.device) as m:
            fn()
        return int(m.peak_bytes)

    def step_peak(self, fn: Callable[[], Any], model: nn.Module) -> tuple[int, int]:
        """(the step peak of `fn()` per PEAK_DEFINITION, its peak above the level at entry)."""
        entry = torch.cuda.memory_allocated() if self.device == "cuda" else model_bytes(model)
        above = self.measure(fn)
        return entry + above, above


def telemetry_memory(stats: Any) -> tuple[dict[str, Any], int]:
    """(JSON form of a tapesac step's MemoryStats, its peak above the step baseline). That peak is the figure
    comparable with PeakMeter's (bytes above the level at step entry); MemoryStats.peak_bytes adds the baseline
    (parameters, buffers, gradients)."""
    mem = stats.memory
    return jsonable(mem.to_dict()), int(mem.peak_above_baseline_bytes)


GRAPH_COUNTERS = ("graph_replays", "graph_captures", "graph_fallbacks", "graph_staged_bytes", "graph_nodes_enabled",
                  "graph_nodes_disabled")


def graph_stats(stats: Any) -> dict[str, Any] | None:
    """The CUDA-graph counters of a tapesac step summed over its block calls, with the distinct fallback reasons;
    None when the step had no block call."""
    if not stats.blocks:
        return None
    out: dict[str, Any] = {k: sum(getattr(b, k) for b in stats.blocks) for k in GRAPH_COUNTERS}
    out["graph_fallback_reasons"] = sorted({b.graph_fallback for b in stats.blocks} - {""})
    return out


def graph_launch_times(history: Any, top: int = 8) -> dict[str, Any] | None:
    """The per-op times of the timed graph launches in a tapesac's step history (TapeSAC(graph_timing=...); by
    default each graph's first launch, during the priming steps): per timed block call its step, source, device
    time, unattributed time and its `top` most expensive ops; the notes of launches that were to be timed and were
    not. None when nothing was timed or noted."""
    timed, notes = [], set()
    for st in history:
        for b in st.blocks:
            if b.graph_timing_note:
                notes.add(b.graph_timing_note)
            if b.graph_timed_launches:
                ops = sorted(b.graph_op_ms, key=lambda t: -t[2])[:top]
                timed.append({"step": st.step, "block": b.name, "launches": b.graph_timed_launches,
                              "source": b.graph_timing, "device_ms": b.graph_device_ms,
                              "unattributed_ms": b.graph_unattributed_ms,
                              "top_ops_ms": [[i, n, ms] for i, n, ms in ops]})
    if not timed and not notes:
        return None
    return {"timed": timed, "notes": sorted(notes)}


def jsonable(x: Any) -> Any:
    """x with dict keys as strings, tuples as lists, dataclasses as dicts, and anything not JSON as its repr."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if dataclasses.is_dataclass(x):
        return jsonable(dataclasses.asdict(x))
    return repr(x)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (so NaNs with the same bits are equal, and -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, tiny): the error relative to the tensor's scale."""
    d = (got.double() - want.double()).abs().max().item()
    return d / max(want.double().abs().max().item(), 1e-30)


@dataclass
class Snapshot:
    """One validation step: its loss and every parameter's gradient (None where the parameter got none)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms(True, warn_only=True) while open (validation steps on CUDA only: the
    deterministic kernels may be slower, so timed steps run without it)."""
    if not on:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def run_once(v: Variant, work: Workload, seed: int) -> Snapshot:
    """One step of `v` from `seed`; returns loss and cloned gradients and zeroes the gradients."""
    model = work.model if v.model is None else v.model
    torch.manual_seed(seed)
    cuda = work.size.device.startswith("cuda")
    with deterministic(cuda), (v.context() if v.context else contextlib.nullcontext()):
        loss = v.step()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return Snapshot(loss.detach().clone(), grads)


def compare(got: Snapshot, want: Snapshot, rtol: float | None) -> tuple[bool, str, float]:
    """(valid, detail, max relative diff). rtol None: bitwise."""
    pairs = [("loss", got.loss, want.loss)]
    if list(got.grads) != list(want.grads):
        return False, f"parameter names differ: {sorted(set(got.grads) ^ set(want.grads))[:4]}", math.inf
    for n, g in want.grads.items():
        h = got.grads[n]
        if (g is None) != (h is None):
            return False, f"grad of {n}: {'missing' if h is None else 'present'}, reference " \
                          f"{'missing' if g is None else 'present'}", math.inf
        if g is not None:
            pairs.append((f"grad of {n}", h, g))
    worst, worst_name = 0.0, ""
    for name, a, b in pairs:
        if a.shape != b.shape:
            return False, f"{name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}", math.inf
        if bits_equal(a, b):
            continue
        r = rel_diff(a, b)
        if r > worst:
            worst, worst_name = r, name
        if rtol is None:
            return False, f"{name} not bitwise equal to no checkpointing (max diff {r:.2e} of its max)", r
    if rtol is not None and worst > rtol:
        return False, f"{worst_name}: relative difference {worst:.2e} > tolerance {rtol:g}", worst
    n = len(pairs)
    if worst == 0.0:
        return True, f"loss and {n - 1} gradients bitwise equal", 0.0
    return True, f"loss and {n - 1} gradients within rtol {rtol:g} (max {worst:.2e}, {worst_name})", worst

