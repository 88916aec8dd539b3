# tapesac.bench.run — one workload through the suite: make the variants, validate and measure each, time them.
#
# Contract:
# - `bench_workload(work, args, tapesac, meter, progress, factories) -> dict`: the workload's JSON record, with
#   `variants` (name -> result) in the order the factories made them. Variants not named by --variants are closed
#   and left out (nockpt always runs); a factory that raises is recorded as an error (required for nockpt_variants
#   and tapesac_variants, optional otherwise) and the suite goes on.
# - Validation before timing: the baseline runs twice (not bitwise reproducible -> exact variants get DEVICE_RTOL);
#   every other variant runs `prime_steps` discarded steps, then one step compared with the baseline: bitwise for
#   exact variants, COMPILE_RTOL for torch.compile; a checkpoint variant must run each block's forward twice; tapesac
#   "none" must drop nothing, "full" must drop and replay, cuda_graph must launch graphs. An invalid variant is
#   reported and never timed or measured. A tapesac variant with a memory limit that tapesac declines
#   (MemoryLimitError: infeasible on the workload) is skipped with that reason.
# - Peak memory: one more step per valid variant, under `meter`: `peak_bytes` is the step peak (PEAK_DEFINITION),
#   `peak_above_entry_bytes` the part above the level at entry. Timing: harness.interleaved_rounds (warm-up,
#   rotating order, gc off); a variant that raises while timed becomes an error and leaves the rounds.
# - Ratios: medians of per-round ratios to nockpt and ckpt (paired), and ratios of medians and of minima; recompute
#   time: tapesac's measured replay_ms, else median step - median nockpt step (labelled an estimate).
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from ..progress import Progress
from . import harness
from .measure import (COMPILE_RTOL, DEVICE_RTOL, PeakMeter, Snapshot, compare, graph_launch_times, graph_stats,
                      jsonable, run_once, sync, telemetry_memory)
from .sizes import Workload
from .variants import (CKPT, NOCKPT, VARIANT_FACTORIES, Ctx, Variant, nockpt_variants, tapesac_variants,
                       variant_names)


def short_error(e: BaseException) -> str:
    """The first line of "Type: message", at most 400 characters (for a table cell and the JSON)."""
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:400]


def _model_of(v: Variant, work: Workload) -> torch.nn.Module:
    return work.model if v.model is None else v.model


def _validation(v: Variant, work: Workload, snap: Snapshot, ref: Snapshot, rtol_exact: float | None) -> dict[str, Any]:
    """The validation record of a variant's step against the reference: equal within its tolerance, and the
    variant really did its job (checkpointed, dropped and replayed, launched graphs)."""
    rtol = COMPILE_RTOL.get(work.size.dtype, 5e-2) if not v.exact else rtol_exact
    ok, detail, worst = compare(snap, ref, rtol)
    method = "bitwise" if rtol is None else f"rtol {rtol:g}"
    if ok and v.block_forwards is not None and v.counter is not None and v.counter[0] != v.block_forwards:
        ok, detail = False, (f"did not checkpoint: {v.counter[0]} block forwards in one step, expected "
                             f"{v.block_forwards} (each of the {len(work.blocks)} blocks run again in backward)")
    if ok and v.sac is not None:
        st = v.sac.last_step
        if st.policy == "none" and st.dropped_bytes:
            ok, detail = False, f'policy "none" dropped {st.dropped_bytes} bytes'
        if st.policy == "full" and (not st.dropped_bytes or not st.ops_replayed):
            ok, detail = False, (f'policy "full" dropped {st.dropped_bytes} bytes and replayed '
                                 f"{st.ops_replayed} ops: tapesac did nothing")
        graphs = graph_stats(st)
        if ok and v.info.get("expect_graph_replays") and not (graphs or {}).get("graph_replays"):
            found = graphs if graphs is not None else "no block call"
            ok, detail = False, (f"backend='cuda_graph' launched no graph in the validated step (step "
                                 f"{v.prime_steps + 1}): {found}")
    return {"valid": ok, "detail": detail, "max_rel_diff": worst, "method": method}


def _tapesac_readings(v: Variant) -> dict[str, Any]:
    """What a tapesac variant's validated step reports: counts, bytes, replay time, backend, graph counters."""
    st = v.sac.last_step
    out = {k: getattr(st, k) for k in ("ops_recorded", "saved_tensors", "kept_tensors", "dropped_tensors",
                                       "kept_bytes", "dropped_bytes", "opaque_bytes", "replays", "ops_replayed",
                                       "replay_ms")}
    out["backend"] = v.sac.backend
    graphs = graph_stats(st)
    if graphs is not None:
        out.update(graphs)
    launch_times = graph_launch_times(v.sac.history)
    if launch_times is not None:
        out["graph_launch_times"] = launch_times
    return out


def _measure_peak(v: Variant, ctx: Ctx, meter: PeakMeter, res: dict[str, Any]) -> None:
    """One more step under the meter (the validation step warmed the variant up); tapesac's own figure beside it."""
    def one() -> None:
        torch.manual_seed(ctx.args.seed)
        with (v.context() if v.context else contextlib.nullcontext()):
            v.step()

    model = _model_of(v, ctx.work)
    peak, above = meter.step_peak(one, model)
    model.zero_grad(set_to_none=True)
    res["peak_bytes"] = peak  # the step peak (PEAK_DEFINITION)
    res["peak_above_entry_bytes"] = above
    if "memory_limit_bytes" in v.info:
        res["within_limit"] = peak <= v.info["memory_limit_bytes"]
    if v.sac is not None:
        res["telemetry_memory"], tel_peak = telemetry_memory(v.sac.last_step)
        res["telemetry_peak_bytes"] = tel_peak
        if tel_peak:
            res["telemetry_peak_ratio_to_measured"] = tel_peak / above if above else None


def _validate_and_measure(v: Variant, ctx: Ctx, ref: Snapshot | None, rtol_exact: float | None,
                          meter: PeakMeter, res: dict[str, Any]) -> bool:
    """Fills res with validation and peak memory; True when the variant may be timed. `ref` None: v is the
    baseline, the reference itself."""
    work = ctx.work
    try:
        for _ in range(v.prime_steps):
            run_once(v, work, ctx.args.seed)
        if v.counter is not None:
            v.counter[0] = 0
        snap = run_once(v, work, ctx.args.seed)
        if ref is None:
            res["validation"] = {"valid": True, "detail": "reference", "max_rel_diff": 0.0, "method": "reference"}
        else:
            res["validation"] = _validation(v, work, snap, ref, rtol_exact)
            if not res["validation"]["valid"]:
                res["status"], res["reason"] = "invalid", res["validation"]["detail"]
                return False
        if v.counter is not None:
            res["block_forwards_per_step"] = v.counter[0]
        if v.sac is not None:
            res["tapesac"] = _tapesac_readings(v)
        _measure_peak(v, ctx, meter, res)
        return True
    except Exception as e:  # one broken variant must not stop the suite
        _model_of(v, work).zero_grad(set_to_none=True)
        if "memory_limit_bytes" in v.info and isinstance(e, ctx.tapesac.MemoryLimitError):
            # tapesac declining a limit it cannot meet on this workload (DESIGN: an infeasible limit fails fast and
            # names the smallest feasible one) is an answer about the limit the suite chose, not a failure.
            res["status"], res["reason"] = "skipped", f"limit infeasible on this workload: {short_error(e)}"
            return False
        res["status"], res["reason"] = "error", short_error(e)
        return False


def _close(v: Variant) -> None:
    if v.sac is not None:
        v.sac.close()


def _validate_all(ctx: Ctx, meter: PeakMeter, progress: Progress,
                  factories: Sequence[Callable[[Ctx], list[Variant]]], out: dict[str, Any]) -> list[Variant]:
    """Makes the variants factory by factory and validates and measures each as it comes (a later factory reads
    ctx.results); fills ctx.results and `out`'s reference fields; returns the variants that may be timed."""
    work, args, results = ctx.work, ctx.args, ctx.results
    wanted = set(args.variants.split(",")) if args.variants else None
    runnable: list[Variant] = []
    made_names: set[str] = set()
    ref: Snapshot | None = None
    rtol_exact: float | None = None
    # The default suite's names are known up front (variant_names: --variants is checked against them before any
    # run); a factory making a name missing there is a bug of the suite, caught by every run of it.
    catalogue = variant_names(args) if factories is VARIANT_FACTORIES else None
    for factory in factories:
        try:
            made = factory(ctx)
        except Exception as e:
            name = factory.__name__.removesuffix("_variants")
            required = factory in (nockpt_variants, tapesac_variants)
            results[name] = {"label": name, "kind": "?", "status": "error", "optional": not required,
                             "reason": f"variant factory failed: {short_error(e)}"}
            continue
        for v in made:
            if catalogue is not None and v.name not in catalogue:
                raise AssertionError(f"bench: {factory.__name__} made variant {v.name!r}, which "
                                     f"variants.variant_names() does not list: add it there")
            made_names.add(v.name)
            if wanted is not None and v.name not in wanted and v.name != NOCKPT:
                _close(v)
                continue
            res: dict[str, Any] = {"label": v.label, "kind": v.kind, "status": v.status or "ok",
                                   "optional": v.optional, "info": jsonable(v.info)}
            results[v.name] = res
            if v.status:
                res["reason"] = v.reason
                continue
            progress(f"{work.name}: validating {v.name}", force=True)
            if v.name == NOCKPT:
                try:
                    ref = run_once(v, work, args.seed)
                    again = run_once(v, work, args.seed)
                except Exception as e:
                    work.model.zero_grad(set_to_none=True)
                    res["status"], res["reason"] = "error", f"the reference step failed: {short_error(e)}"
                    continue
                same, _, _ = compare(again, ref, None)
                if not same:
                    # Not reproducible on this device: bitwise comparison would fail every variant.
                    rtol_exact = DEVICE_RTOL
                out["reference_reproducible"] = same
            elif ref is None:
                res["status"], res["reason"], res["optional"] = "skipped", "no reference: the nockpt step failed", True
                _close(v)
                continue
            if _validate_and_measure(v, ctx, None if v.name == NOCKPT else ref, rtol_exact, meter, res):
                runnable.append(v)
    out["exact_rtol"] = rtol_exact
    if wanted is not None:
        # A misspelt --variants name must not silently run nothing.
        out["unknown_variants"] = sorted(wanted - made_names)
        out["known_variants"] = sorted(made_names)
    return runnable


def _time(runnable: list[Variant], ctx: Ctx, progress: Progress) -> tuple[dict[str, list[float]],
                                                                          dict[str, list[float]], set[str]]:
    """(step seconds per variant, tapesac replay ms per variant, the variants that failed while timed)."""
    work, args, results = ctx.work, ctx.args, ctx.results
    by_name = {v.name: v for v in runnable}
    replay: dict[str, list[float]] = {v.name: [] for v in runnable if v.sac is not None}
    failed: set[str] = set()

    def sample(name: str) -> float:
        v = by_name[name]
        model = _model_of(v, work)
        torch.manual_seed(args.seed)
        cm = v.context() if v.context else contextlib.nullcontext()
        sync(ctx.cuda)
        t0 = time.perf_counter()
        with cm:
            v.step()
        model.zero_grad(set_to_none=True)
        sync(ctx.cuda)
        return time.perf_counter() - t0

    def before(name: str, r: int) -> None:
        warm = r < args.warmup
        progress(f"{work.name}: {'warm-up' if warm else 'round'} {r + 1 - (0 if warm else args.warmup)}/"
                 f"{args.warmup if warm else args.rounds} {name}")

    def after(name: str) -> None:
        if name in replay:
            replay[name].append(by_name[name].sac.last_step.replay_ms)

    def on_error(name: str, e: Exception) -> None:
        _model_of(by_name[name], work).zero_grad(set_to_none=True)
        failed.add(name)
        results[name]["status"] = "error"
        results[name]["reason"] = f"failed while timing: {short_error(e)}"

    times = harness.interleaved_rounds(list(by_name), sample, rounds=args.rounds, warmup=args.warmup,
                                       before=before, after=after, on_error=on_error)
    return times, replay, failed


def _ratios(runnable: list[Variant], results: dict[str, dict[str, Any]], times: dict[str, list[float]],
            replay: dict[str, list[float]], failed: set[str]) -> None:
    """Step-time statistics, time and peak ratios to nockpt and ckpt, and recompute time, into each result."""
    base_t = times.get(NOCKPT) if NOCKPT not in failed else None
    ckpt_t = times.get(CKPT) if CKPT not in failed and CKPT in times else None
    base_peak = results.get(NOCKPT, {}).get("peak_bytes")
    ckpt_peak = results.get(CKPT, {}).get("peak_bytes") if results.get(CKPT, {}).get("status") == "ok" else None
    for v in runnable:
        res = results[v.name]
        if v.name in failed or not times[v.name]:
            continue
        t = times[v.name]
        res["step_ms"] = harness.stats(t, scale=1e3)
        med = statistics.median(t)
        # Three views of the same ratio: paired per round (the headline), of the medians, and of the minima (other
        # processes only add time, so the minima are the least disturbed samples).
        for key, other in (("nockpt", base_t), ("ckpt", ckpt_t)):
            if other:
                res[f"time_ratio_{key}"] = harness.paired_ratio(t, other)
                res[f"time_ratio_{key}_of_medians"] = med / statistics.median(other)
                res[f"time_ratio_{key}_of_mins"] = min(t) / min(other)
        if base_peak:
            res["peak_ratio_nockpt"] = res["peak_bytes"] / base_peak
        if ckpt_peak:
            res["peak_ratio_ckpt"] = res["peak_bytes"] / ckpt_peak
        if v.sac is not None:
            res["recompute_ms"] = statistics.median(replay[v.name])
            res["recompute_method"] = "measured: sac.last_step.replay_ms (median over timed steps)"
        elif v.name == NOCKPT:
            res["recompute_ms"] = 0.0
            res["recompute_method"] = "none (baseline)"
        elif base_t:
            res["recompute_ms"] = (med - statistics.median(base_t)) * 1e3
            res["recompute_method"] = "estimate: median step - median no-checkpoint step"
        if base_t and v.name != NOCKPT:
            res["overhead_ms_vs_nockpt"] = (med - statistics.median(base_t)) * 1e3


def bench_workload(work: Workload, args: argparse.Namespace, tapesac: Any, meter: PeakMeter,
                   progress: Progress, factories: Sequence[Callable[[Ctx], list[Variant]]]) -> dict[str, Any]:
    """The workload's record: its description, the reference fields, and every variant's result (see Contract)."""
    results: dict[str, dict[str, Any]] = {}
    ctx = Ctx(work=work, args=args, tapesac=tapesac, results=results)
    out: dict[str, Any] = {"name": work.name, "model": work.arch, "size": work.size_name,
                           "description": work.description, "batch": work.size.batch, "seq": work.size.seq,
                           "dtype": work.size.dtype, "device": work.size.device, "blocks": len(work.blocks)}
    runnable = _validate_all(ctx, meter, progress, factories, out)
    times, replay, failed = _time(runnable, ctx, progress)
    _ratios(runnable, results, times, replay, failed)
    for v in runnable:
        _close(v)
    out["variants"] = results
    return out
