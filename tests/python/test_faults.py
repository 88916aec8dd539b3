"""Faults inside a step: an exception in a block's forward, in the backward (a raising tensor hook, also while
a replayed block's gradients are computed), a KeyboardInterrupt in the forward and in the backward, and a
ReplayContractError raised by tapesac itself in the middle of the backward.

After each fault:
- the exception that comes out is the very object raised (or the documented tapesac error);
- no module hook and no saved-tensor hook is left, grad mode is on;
- memory returns to its baseline: every tensor the faulty step's blocks created (storage weak references, after
  the exception and its traceback are gone) is released, and, with tapesac.MemoryMeter, the bytes allocated during
  the faulty step and still alive are zero;
- the same TapeSAC instance runs the next step bitwise equal to a plain run, with the same statistics as a
  step before the fault (no tape, recorder or replay state left over).

(A MemoryLimitError in the middle of a replay is the memory-limit issue's test.)
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import models as M
from robust_helpers import (assert_exact_step, assert_hooks_unchanged, assert_no_saved_tensor_hooks,
                            assert_no_tapesac_hooks,
                            hook_snapshot, small_input)

D = 16


class Injected(Exception):
    pass


class FaultBlock(nn.Module):
    """fc1 -> gelu -> fc2 with weak references to the storages of its intermediates, and a switch that raises
    `self.error` after gelu (inside the block, with the block open and some tensors saved)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.error: BaseException | None = None
        self.refs: list[tuple[str, StorageWeakRef]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        a = F.gelu(h)
        self.refs += [("fc1_out", StorageWeakRef(h.untyped_storage())), ("gelu_out", StorageWeakRef(a.untyped_storage()))]
        if self.error is not None:
            raise self.error
        y = torch.tanh(self.fc2(a))
        self.refs.append(("out", StorageWeakRef(y.untyped_storage())))
        return y


class FaultStack(nn.Module):
    def __init__(self, n: int = 3, d: int = D):
        super().__init__()
        self.blocks = nn.ModuleList(FaultBlock(d) for _ in range(n))
        self.between: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i == len(self.blocks) - 2:
                self.between = x  # the last block's input, for the replay-contract fault
        return x


def make_model() -> FaultStack:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FaultStack()


def _alive(model: FaultStack) -> list[str]:
    return [f"blocks.{i}:{k}" for i, b in enumerate(model.blocks) for k, r in b.refs if not r.expired()]


def _clear_refs(model: FaultStack) -> None:
    for b in model.blocks:
        b.refs.clear()


# ----------------------------------------------------------------------------------------------------------------------
# Faults: each runs one faulty step and returns (what it raised, what the test must see come out)
# ----------------------------------------------------------------------------------------------------------------------


def _fault_forward(exc: BaseException, block: int) -> Callable:
    def run(sac, model):
        model.blocks[block].error = exc
        try:
            with sac.step():
                model(small_input(D)).square().mean().backward()
        finally:
            model.blocks[block].error = None
    return run


def _fault_after_forward(exc: BaseException) -> Callable:
    def run(sac, model):
        with sac.step():
            loss = model(small_input(D)).square().mean()
            raise exc
    return run


def _fault_backward_hook(exc: BaseException, on: str) -> Callable:
    """A tensor hook raising during backward: on the first block's output (blocks 2 and 1 were replayed and their
    gradients computed already), or on an intermediate of the last block (raised while that block's replayed
    tensors are in use)."""
    def run(sac, model):
        handle = None
        if on == "intermediate":
            def fwd_hook(_m, _a, out):
                out.register_hook(lambda g: (_ for _ in ()).throw(exc))
            handle = model.blocks[-1].fc1.register_forward_hook(fwd_hook)
        try:
            with sac.step():
                x = small_input(D)
                h = model.blocks[0](x)
                if on == "block0_output":
                    h.register_hook(lambda g: (_ for _ in ()).throw(exc))
                for blk in model.blocks[1:]:
                    h = blk(h)
                h.square().mean().backward()
        finally:
            if handle is not None:
                handle.remove()
    return run


def _fault_replay_contract() -> Callable:
    """The last block's input is modified in place between forward and backward: the replay that needs it must
    refuse (ReplayContractError), in the middle of the backward."""
    def run(sac, model):
        with sac.step():
            loss = model(small_input(D)).square().mean()
            with torch.no_grad():
                model.between.mul_(1.0)  # same values, new version: replay cannot trust it
            model.between = None
            loss.backward()
    return run


@dataclass
class Fault:
    name: str
    make: Callable[[], tuple[Callable, type, BaseException | None]]  # -> (run, expected type, exact object or None)


def _with(exc_factory, builder):
    def make():
        exc = exc_factory()
        return builder(exc), type(exc), exc
    return make


def _contract():
    import tapesac

    return _fault_replay_contract(), tapesac.ReplayContractError, None


FAULTS = [
    Fault("value_error_in_block1_forward", _with(lambda: Injected("in block 1"), lambda e: _fault_forward(e, 1))),
    Fault("value_error_in_block0_forward", _with(lambda: Injected("in block 0"), lambda e: _fault_forward(e, 0))),
    Fault("value_error_in_last_block_forward", _with(lambda: Injected("in block 2"), lambda e: _fault_forward(e, 2))),
    Fault("keyboard_interrupt_in_forward", _with(KeyboardInterrupt, lambda e: _fault_forward(e, 1))),
    Fault("error_after_forward", _with(lambda: Injected("after forward"), _fault_after_forward)),
    Fault("raising_hook_on_block0_output", _with(lambda: Injected("hook"), lambda e: _fault_backward_hook(e, "block0_output"))),
    Fault("raising_hook_inside_replayed_block", _with(lambda: Injected("hook"), lambda e: _fault_backward_hook(e, "intermediate"))),
    Fault("keyboard_interrupt_in_backward", _with(KeyboardInterrupt, lambda e: _fault_backward_hook(e, "block0_output"))),
    Fault("replay_contract_error_mid_backward", _contract),
]

pytestmark = pytest.mark.usefixtures("one_thread")


POLICIES = [pytest.param("full", id="full"), pytest.param({"aten::addmm"}, id="save_addmm"),
            pytest.param("none", id="none")]


def _run_fault(fault: Fault, sac, model) -> str:
    """Runs the faulty step; returns a description of what came out. Nothing of the exception (traceback, frames,
    locals) survives this function."""
    run, want_type, want_obj = fault.make()
    try:
        run(sac, model)
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included on purpose
        got = e
    else:
        raise AssertionError(f"{fault.name}: the faulty step raised nothing (expected {want_type.__name__})")
    try:
        if want_obj is not None:
            assert got is want_obj, f"{fault.name}: expected the raised object {want_obj!r} to come out, got {got!r}"
        else:
            assert isinstance(got, want_type), f"{fault.name}: expected {want_type.__name__}, got {got!r}"
            assert str(got).strip(), f"{fault.name}: empty message"
        return type(got).__name__
    finally:
        got.__traceback__ = None
        del got


def _warm_stats(st) -> tuple:
    return (st.block_calls, st.ops_recorded, st.saved_tensors, st.kept_tensors, st.dropped_tensors, st.kept_bytes,
            st.dropped_bytes, st.ops_replayed, st.replays)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_leaves_no_state_and_next_step_is_exact(fault: Fault, policy: Any) -> None:
    import tapesac

    if fault.name == "replay_contract_error_mid_backward" and policy == "none":
        pytest.skip("policy 'none' replays nothing, so no replay can refuse (plain autograd's own check runs)")
    model = make_model()
    ref = copy.deepcopy(model)
    before = hook_snapshot(model)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    try:
        # Two warm-up steps: with planned replay schedules (policy "full"'s default) the plan made after the first
        # is what every later step runs, so the second's statistics are the ones a clean step repeats.
        for when in ("warm-up", "second warm-up"):
            warm = assert_exact_step(sac, model, ref=ref, policy=policy, expect_drop=policy == "full", when=when)
            _clear_refs(model)
            model.zero_grad(set_to_none=True)

        _run_fault(fault, sac, model)
        n_refs = sum(len(b.refs) for b in model.blocks)
        assert n_refs > 0, f"{fault.name}: the faulty step created no tracked tensor; the memory check is empty"

        assert_hooks_unchanged(model, before, f"after {fault.name}")
        assert_no_saved_tensor_hooks(f"after {fault.name}")
        model.zero_grad(set_to_none=True)
        model.between = None
        # No gc.collect(): memory must be released by reference counting once the exception is gone.
        assert _alive(model) == [], f"after {fault.name}: tensors of the faulty step are still alive: {_alive(model)}"

        after = assert_exact_step(sac, model, ref=ref, policy=policy, expect_drop=policy == "full",
                                  when=f"the step after {fault.name}")
        assert _warm_stats(after) == _warm_stats(warm), (
            f"after {fault.name} the same step has different statistics (leftover state):\n  before the fault "
            f"{_warm_stats(warm)}\n  after the fault  {_warm_stats(after)}  (block_calls, ops_recorded, saved, kept, "
            f"dropped, kept_bytes, dropped_bytes, ops_replayed, replays)")
    finally:
        sac.close()
    assert_hooks_unchanged(model, before, f"after close following {fault.name}")
    assert_no_tapesac_hooks(model, f"after close following {fault.name}")


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_memory_returns_to_baseline(fault: Fault) -> None:
    """tapesac.MemoryMeter around the faulty step: after the exception is gone, nothing allocated during the step
    is still alive (current_bytes == 0), and the step did allocate (peak_bytes > 0: the meter saw the step)."""
    import tapesac

    model = make_model()
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        assert_exact_step(sac, model, ref=ref, when="warm-up")  # first-call allocations (oneDNN, caches) happen here
        model.zero_grad(set_to_none=True)
        with tapesac.MemoryMeter() as m:
            _run_fault(fault, sac, model)
            model.zero_grad(set_to_none=True)
            model.between = None
            _clear_refs(model)
            gc.collect()
            current, peak = m.current_bytes, m.peak_bytes
        assert peak > 0, f"{fault.name}: the meter saw no allocation during the faulty step (peak_bytes={peak})"
        assert current == 0, (
            f"{fault.name}: {current} bytes allocated during the faulty step are still alive after it "
            f"(peak {peak}); expected 0")
        assert_exact_step(sac, model, ref=ref, when=f"the step after {fault.name}")
    finally:
        sac.close()


def test_memory_baseline_over_repeated_faults() -> None:
    """20 faulty steps of mixed kinds in a row: live tensors (gc) and the storages of every block intermediate
    return to the level of a clean step each time, and the instance keeps working."""
    import tapesac

    from robust_helpers import live_tensor_count

    model = make_model()
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        assert_exact_step(sac, model, ref=ref, when="warm-up")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        base = live_tensor_count()
        counts = []
        for i in range(20):
            _run_fault(FAULTS[i % len(FAULTS)], sac, model)
            model.zero_grad(set_to_none=True)
            model.between = None
            _clear_refs(model)
            if i in (9, 19):  # a gc scan is slow once transformers is imported: two samples
                counts.append(live_tensor_count())
        assert max(counts) <= base, f"live tensors grow over faulty steps: baseline {base}, after each: {counts}"
        assert_exact_step(sac, model, ref=ref, when="the step after 20 faults")
    finally:
        sac.close()


def test_fault_in_one_instance_does_not_affect_another() -> None:
    """Two TapeSACs on two models, used alternately: a fault in one leaves the other's next step exact."""
    import tapesac

    a, b = make_model(), make_model()
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    sa = tapesac.TapeSAC(a, blocks="blocks.*", policy="full")
    sb = tapesac.TapeSAC(b, blocks="blocks.*", policy="full")
    try:
        assert_exact_step(sb, b, ref=rb, when="b before")
        _run_fault(FAULTS[0], sa, a)
        assert_exact_step(sb, b, ref=rb, when="b after a's fault")
        _run_fault(FAULTS[5], sb, b)
        assert_exact_step(sa, a, ref=ra, when="a after b's fault")
        assert_exact_step(sb, b, ref=rb, when="b after its own fault")
    finally:
        sa.close()
        sb.close()
