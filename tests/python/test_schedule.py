"""Replay schedules (Note [Replay schedule] in replay/schedule.h; Config.schedule) and the memory limit as a promise.

A schedule changes when a block's dropped values are replayed, never what is computed: every schedule shape gives
bitwise the gradients of the plain run (reference scenarios, retain_graph, several SGD steps, the emulated graph
backend with one launch per segment). A step whose measured peak exceeds memory_limit is flagged in StepStats
(over_limit, over_limit_bytes) and warned once through the "tapesac" logger, or the step raises MemoryLimitError;
it is never silently over.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn

import models as M
from conftest import assert_same_grads, reference_check
from robust_helpers import assert_no_tapesac_hooks
from test_reference import MATMULS, scenario

SHAPES = ["hold_all", "lazy"]
NAMES = ["mlp", "attention", "dropout", "random_ops", "inplace", "views", "multi_output", "hf_llama", "hf_qwen3",
         "hf_qwen3_moe", "hf_qwen3_moe_eager_experts"]


def _segmented(res) -> bool:
    return any(b.segments > 1 for st in res.all_stats for b in st.blocks)


@pytest.mark.parametrize("policy", [pytest.param("full", id="full"), pytest.param(MATMULS, id="save_matmuls")])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_reference_under_a_schedule(name: str, shape: str, policy: Any) -> None:
    s = scenario(name)
    res = reference_check(s.make_model, s.make_inputs, policy, s.blocks, s.loss_fn, block_calls=s.block_calls,
                          sac_kwargs={"schedule": shape})
    if policy == "full":  # an op set may leave a block one dropped value (one segment)
        assert _segmented(res), "no block call followed a schedule of more than one segment"


def test_lazy_replays_per_segment_and_default_replays_once() -> None:
    """One segment (the default) replays once per block call; 'lazy' once per segment that had anything to rebuild."""
    s = scenario("hf_qwen3")
    one = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, block_calls=s.block_calls)
    lazy = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, block_calls=s.block_calls,
                           sac_kwargs={"schedule": "lazy"})
    assert [b.segments for b in one.stats.blocks] == [1] * s.block_calls
    assert one.stats.replays == s.block_calls
    assert lazy.stats.replays > 3 * s.block_calls
    assert lazy.stats.memory.peak_bytes <= one.stats.memory.peak_bytes


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["mlp", "dropout", "hf_qwen3"])
def test_retain_graph_two_backwards_under_a_schedule(name: str, shape: str) -> None:
    s = scenario(name)

    def backward(loss: torch.Tensor) -> None:
        loss.backward(retain_graph=True)
        loss.backward()

    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, backward_fn=backward,
                          block_calls=s.block_calls, sac_kwargs={"schedule": shape})
    assert _segmented(res)


@pytest.mark.parametrize("shape", SHAPES + ["planned"])
@pytest.mark.parametrize("name", ["attention", "inplace", "hf_qwen3", "hf_qwen3_moe"])
def test_three_steps_with_sgd_under_a_schedule(name: str, shape: str) -> None:
    """'planned' plans the schedules after the first step (the least predicted peak for policy 'full')."""
    s = scenario(name)
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, steps=3,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), block_calls=s.block_calls,
                          sac_kwargs={"schedule": shape})
    assert [st.step for st in res.all_stats] == [1, 2, 3]
    if shape != "planned":
        assert _segmented(res)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["mlp", "hf_qwen3"])
def test_emulated_graph_launches_once_per_segment(name: str, shape: str) -> None:
    s = scenario(name)
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, steps=3,
                          block_calls=s.block_calls, sac_kwargs={"schedule": shape, "backend": "emulated_graph"})
    last = res.all_stats[-1]
    assert last.graph_replays > 0
    if shape == "lazy":
        assert last.graph_replays > s.block_calls  # several launches of one block call's graph


def test_unknown_schedule_is_a_config_error() -> None:
    import tapesac

    with pytest.raises(tapesac.ConfigError, match="schedule"):
        tapesac.TapeSAC(M.Stack([M.MLPBlock()]), blocks="blocks.*", schedule="eager")


# The limit as a promise: every step is within the limit, or flagged, or raises MemoryLimitError.

def _steps_under_limit(policy: Any, limit_fraction: float, schedule: str = "one_segment", steps: int = 4):
    """Runs `steps` steps of small Qwen3 (gradients set to None before each, so that every step starts alike) under
    memory_limit = limit_fraction x the measured peak of 'full'; returns (limit, per-step stats, error or None)."""
    import tapesac

    def model_and_steps(**kw):
        torch.manual_seed(0)
        model = M.hf_qwen3(3)
        sac = tapesac.TapeSAC(model, blocks="model.layers.*", **kw)
        return model, sac

    def one_step(model, sac):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1000)
        with sac.step():
            M.hf_loss(model, torch.randint(0, M.HF_VOCAB, (M.B, M.T))).backward()
        return sac.last_step

    model, sac = model_and_steps(policy="full")
    try:
        ref_peak = max(one_step(model, sac).memory.peak_bytes for _ in range(2))
    finally:
        sac.close()
    assert_no_tapesac_hooks(model, "the reference TapeSAC")
    limit = int(ref_peak * limit_fraction)
    model, sac = model_and_steps(policy=policy, memory_limit=limit, schedule=schedule)
    error = None
    try:
        for _ in range(steps):
            one_step(model, sac)
    except tapesac.MemoryLimitError as e:  # raised in a replay, or by the planner after a step (which is recorded)
        error = e
    finally:
        sac.close()
    assert_no_tapesac_hooks(model, "the TapeSAC under the limit")
    return limit, list(sac.history), error


POLICIES_UNDER_LIMIT = [pytest.param("full", id="full"), pytest.param(MATMULS, id="save_matmuls"),
                        pytest.param(lambda op: op == "aten::mm", id="callable"), pytest.param("auto", id="auto")]


@pytest.mark.parametrize("policy", POLICIES_UNDER_LIMIT)
@pytest.mark.parametrize("fraction", [0.97, 0.5])
def test_limit_is_met_flagged_or_raised(policy: Any, fraction: float, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tapesac"):
        limit, stats, error = _steps_under_limit(policy, fraction)
    over = [st for st in stats if st.memory.peak_bytes > limit]
    for st in stats:
        assert st.over_limit == (st.memory.peak_bytes > limit), (st.step, st.memory.peak_bytes, limit)
        assert st.over_limit_bytes == max(0, st.memory.peak_bytes - limit)
    warnings = [r for r in caplog.records if r.name == "tapesac" and "over memory_limit" in r.getMessage()]
    # Warned once after a step over the limit that the planner then planned for; when the planner refuses after that
    # step (MemoryLimitError, the step is in the history), the error is the one message (the CLI prints one line).
    refused_last = error is not None and stats and over and over[-1] is stats[-1]
    warned_for = [st for st in over if not (refused_last and st is stats[-1])]
    assert len(warnings) == (1 if warned_for else 0), (len(warnings), [st.step for st in over], error)
    if error is not None:
        assert "bytes" in str(error)
    assert error is not None or len(stats) == 4


def test_a_limit_below_every_schedule_raises_naming_a_peak() -> None:
    """policy 'full' with schedule 'planned': a limit far below what any schedule reaches raises MemoryLimitError
    (in the first replay that cannot fit, or from the planner) naming the bytes that would be needed."""
    limit, stats, error = _steps_under_limit("full", 0.5, schedule="planned")
    assert error is not None
    assert "at least" in str(error)


@pytest.mark.parametrize("policy", ["full", "auto"])
def test_planned_schedules_go_below_the_one_segment_peak(policy: str) -> None:
    """A limit 1.5% below the one-segment peak of 'full' (auto's floor without schedules): with schedule='planned'
    the last planned steps are within it. Policy 'full': the first step is within it too (a block call without a plan
    replays lazily under a limit); the first plan, calibrated on that lazy step, may run over it once (measured: one
    segment predicted at 1,159,752 bytes, run at 1,179,112 — the sequence model's backward term takes a window's
    peak less the whole working set of the schedule that ran), flagged, and the next plan keeps that error as a
    margin. Auto with planned schedules measures the same way (its measuring step runs "full" lazily under the
    limit; before 2026-12-03 it ran one segment without the limit and was over it, flagged)."""
    limit, stats, error = _steps_under_limit(policy, 0.985, schedule="planned")
    assert error is None
    assert all(st.over_limit == (st.memory.peak_bytes > limit) for st in stats)
    assert not stats[0].over_limit, [st.memory.peak_bytes for st in stats]
    assert stats[0].blocks[0].segments > 1  # the first step's calls replayed lazily
    assert sum(st.over_limit for st in stats) <= 1, [st.memory.peak_bytes for st in stats]
    assert not stats[-1].over_limit and not stats[-2].over_limit
    assert stats[-1].memory.peak_bytes <= limit
    assert max(b.segments for b in stats[-1].blocks) > 1


class _SharedBlockStack(nn.Module):
    """blocks[0] runs twice per step, the second time on half the sequence (another tape); blocks[1] between."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([M.MLPBlock(), M.MLPBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.blocks[0](x)
        x = x + self.blocks[1](x)
        return x[:, : M.T // 2] + self.blocks[0](x[:, : M.T // 2])


@pytest.mark.parametrize("policy", ["full", "auto"])
def test_a_block_called_twice_gets_a_plan_per_call(policy: str) -> None:
    """replay::plan_key: the k-th call of a block in a step follows the k-th call's plan. Before, plans were keyed by
    the block's name alone: the second call (another tape) ran without one, every step replanned ("new tape"), and
    under auto at the no-checkpoint peak it dropped values (random program 312)."""
    import tapesac

    def steps(**kw):
        torch.manual_seed(0)
        model = _SharedBlockStack()
        ref = copy.deepcopy(model)
        sac = tapesac.TapeSAC(model, blocks="blocks.*", **kw)
        try:
            out = []
            for _ in range(3):
                for m in (model, ref):
                    m.zero_grad(set_to_none=True)
                torch.manual_seed(7)
                x = M.x_in()
                with sac.step():
                    model(x).square().mean().backward()
                ref(x).square().mean().backward()
                assert_same_grads(model, ref)
                out.append(sac.last_step)
            return out, [p["reason"] for p in sac.plans]
        finally:
            sac.close()

    kw: dict[str, Any] = {"policy": policy}
    if policy == "auto":
        none_stats, _ = steps(policy="none")
        kw["memory_limit"] = max(st.memory.peak_bytes for st in none_stats)
    stats, reasons = steps(**kw)
    assert [b.name for b in stats[-1].blocks] == ["blocks.0", "blocks.1", "blocks.0"]
    for st in stats[1:]:
        assert all(b.planned for b in st.blocks), [(b.name, b.planned) for b in st.blocks]
    assert reasons == ["first step"], reasons  # no "new tape" replans
    if policy == "auto":
        assert stats[-1].dropped_tensors == 0, "a limit at the no-checkpoint peak keeps everything"


def _bench_limits() -> Any:
    """perf/bench_limits.py as a module: its models, batch, checkpointing peak and runs."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_limits", Path(__file__).resolve().parents[2] / "perf" / "bench_limits.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _bench_model(arch: str) -> tuple[Any, Any, torch.Tensor, int, int]:
    """(bench_limits, the bench's small `arch` model, its batch, checkpointing's step peak, the floor: the peak of
    "full" with schedule="lazy")."""
    bench = _bench_limits()
    from tapesac.bench.sizes import SIZES, build_model

    size = SIZES["small"]
    model = build_model(arch, size, seed=0)
    ids = bench._ids(model, size.batch, size.seq)
    ckpt = bench.ckpt_peak(model, ids)
    floor = max(bench.run(model, ids, 2, policy="full", schedule="lazy")["peaks"])
    return bench, model, ids, ckpt, floor


def test_auto_plans_below_checkpointings_peak_on_the_bench_model() -> None:
    """`python perf/bench_limits.py` on the small Qwen3 of the bench (4 decoder layers, batch 4 x 256): policy auto
    with planned schedules at a limit halfway from the floor (full, lazy) to checkpointing's peak runs every step
    after its measuring one within the limit. A peak model that charged each backward window the working sets of
    every call backwarded before it (86aa680) put every plan above checkpointing's peak and refused all such
    limits (MemoryLimitError naming 53.45 MiB); no other test saw it, the one of the tiny model being an xfail."""
    bench, model, ids, ckpt, floor = _bench_model("qwen3")
    assert floor < ckpt
    limit = int(floor + 0.5 * (ckpt - floor))
    r = bench.run(model, ids, 4, policy="auto", memory_limit=limit, schedule="planned")
    assert r["error"] is None, r["error"]
    assert max(r["peaks"][1:]) <= limit, (limit, r["peaks"])
    assert all(f == (p > limit) for p, f in zip(r["peaks"], r["flagged"])), r


def test_full_plans_segmented_schedules_below_checkpointings_peak_on_the_bench_models() -> None:
    """Policy full's default (schedule="planned", no limit) on the bench's small Qwen3 and Llama
    (`perf/bench_limits.py`'s runs, 4 steps): once its schedules are planned, its peak lies well below checkpointing's.
    Planned with the sequence model's window levels, which charge a later segment as if it replayed at the measured
    one-segment replay's moment, the schedules stayed near one segment: measured 2026-12-03, 0.887 and 0.924 of
    checkpointing's peak (fe1a3ec; `python -m tapesac bench` runs 0.887-0.925 and 0.924), and without them 0.841 and
    0.882 (bench runs 0.860 and 0.877). The plans follow measured op costs, so the bound is on the mean of the two:
    0.89."""
    bench = _bench_limits()
    from tapesac.bench.sizes import SIZES, build_model

    size = SIZES["small"]
    ratios = {}
    for name in ("qwen3", "llama"):
        model = build_model(name, size, seed=0)
        ids = bench._ids(model, size.batch, size.seq)
        ckpt = bench.ckpt_peak(model, ids)
        r = bench.run(model, ids, 4, policy="full", schedule="planned")
        assert r["error"] is None, r["error"]
        ratios[name] = max(r["peaks"][2:]) / ckpt
    assert sum(ratios.values()) / 2 <= 0.89, ratios


def test_full_under_a_limit_on_the_bench_moe_keeps_every_step_within_it() -> None:
    """`python perf/bench_limits.py` on the bench's small Qwen3-MoE, policy full at the lowest of its limits (a quarter
    of the way from the floor to checkpointing's peak): the first planned step (step 2) ran 2.3% over the limit
    (flagged) before Note [Working set larger than the measured one] — the lazy measuring step peaked during a
    replay, and the plan held rebuilt values across segments through a later moment of the same window at which the
    backward had more allocated. Every step is within the limit now."""
    bench, model, ids, ckpt, floor = _bench_model("qwen3_moe")
    limit = int(floor + 0.25 * (ckpt - floor))
    r = bench.run(model, ids, 3, policy="full", memory_limit=limit)
    assert r["error"] is None, r["error"]
    assert max(r["peaks"]) <= limit, (limit, [p / limit for p in r["peaks"]])
