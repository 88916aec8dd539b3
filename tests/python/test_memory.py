"""A dropped tensor is really freed, and the step's byte accounting matches what the block saved.

Liveness is observed with weak references to the *storages* of the tensors a block creates (WeakrefMLPBlock,
torch's StorageWeakRef): a storage held by the autograd graph or by tapesac stays alive; a storage that was dropped
is released as soon as the block's forward returns. No gc.collect(): memory must be released by reference
counting, as the allocator sees it.

Sizes: a Stack of 4 MLP blocks, hidden 256 -> 1024 -> 256, input [512, 256] fp32 (2-D, so F.linear is addmm
saving the block input itself): per block, input 512 KiB, fc1 output and gelu output 2 MiB each.
"""

from __future__ import annotations

from typing import Any

import copy

import numpy as np
import pytest
import torch

import models as M
from torch.multiprocessing.reductions import StorageWeakRef
from conftest import assert_same_grads, assert_same_tensor

ROWS, D, HID, NBLK = 512, 256, 1024, 4
FP32 = 4
INPUT_BYTES = ROWS * D * FP32
INTERMEDIATE_BYTES = 2 * ROWS * HID * FP32  # fc1 output + gelu output, per block


def weak_stack() -> M.Stack:
    torch.manual_seed(0)
    return M.Stack([M.WeakrefMLPBlock(D, HID) for _ in range(NBLK)])


def make_x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(ROWS, D)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def alive(model: M.Stack, kind: str) -> list[str]:
    return [f"blocks.{i}:{k}" for i, blk in enumerate(model.blocks) for k, r in blk.refs if k == kind and not r.expired()]


def clear_refs(model: M.Stack) -> None:
    for blk in model.blocks:
        blk.refs.clear()


def test_intermediates_alive_without_tapesac() -> None:
    """Positive control: without tapesac the graph holds both intermediates of every block."""
    model = weak_stack()
    out = model(make_x())
    assert len(alive(model, "fc1_out")) == NBLK and len(alive(model, "gelu_out")) == NBLK
    del out
    assert alive(model, "fc1_out") == [] and alive(model, "gelu_out") == []


@pytest.mark.parametrize("policy", ["full", "none"])
def test_dropped_intermediates_are_freed_after_each_block(policy: str) -> None:
    import tapesac

    model = weak_stack()
    ref = copy.deepcopy(model)
    seen_at_next_block: list[list[str]] = []

    def check_previous_block(i):
        def hook(_mod, _args):
            prev = model.blocks[i - 1]
            seen_at_next_block.append([k for k, r in prev.refs if k != "input" and not r.expired()])
        return hook

    handles = [model.blocks[i].register_forward_pre_hook(check_previous_block(i)) for i in range(1, NBLK)]
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    try:
        x = make_x()
        with sac.step():
            loss = loss_of(model(x))
            if policy == "full":
                # Freed right after each block's forward returned, before the next block ran.
                assert seen_at_next_block == [[]] * (NBLK - 1), seen_at_next_block
                assert alive(model, "fc1_out") == [] and alive(model, "gelu_out") == [], (
                    "policy 'full' dropped these tensors but something still holds them")
            else:
                assert len(alive(model, "fc1_out")) == NBLK and len(alive(model, "gelu_out")) == NBLK
            # Block inputs are kept (the model input is held by this test, the others by tapesac or the graph).
            assert len(alive(model, "input")) == NBLK
            loss.backward()
        stats = sac.last_step
        if policy == "full":
            assert stats.dropped_tensors >= 2 * NBLK and stats.ops_replayed > 0, stats
        ref_loss = loss_of(ref(make_x()))
        ref_loss.backward()
        assert_same_tensor("loss", loss.detach(), ref_loss.detach())
        assert_same_grads(model, ref)
        # After the step and without the graph, tapesac holds nothing: block inputs 1..3 are gone too.
        del loss
        assert alive(model, "fc1_out") == [] and alive(model, "gelu_out") == []
        assert alive(model, "input") == ["blocks.0:input"], alive(model, "input")
    finally:
        for h in handles:
            h.remove()
        sac.close()


@pytest.mark.parametrize("policy", ["full", "none"])
def test_graph_deleted_without_backward_frees_everything(policy: str) -> None:
    import tapesac

    model = weak_stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    try:
        x = make_x()
        with sac.step():
            loss = loss_of(model(x))
            assert len(alive(model, "input")) == NBLK
            del loss
            # The tape must not keep block inputs or intermediates alive once the graph is gone.
            assert alive(model, "fc1_out") == [] and alive(model, "gelu_out") == []
            assert alive(model, "input") == ["blocks.0:input"], alive(model, "input")
        assert alive(model, "input") == ["blocks.0:input"]
    finally:
        sac.close()


def test_no_growth_over_steps() -> None:
    import tapesac

    model = weak_stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        kept = []
        for _ in range(4):
            clear_refs(model)
            x = make_x()
            with sac.step():
                loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert alive(model, "fc1_out") == [] and alive(model, "gelu_out") == []
            assert alive(model, "input") == ["blocks.0:input"]
            kept.append((sac.last_step.kept_bytes, sac.last_step.dropped_bytes, sac.last_step.ops_replayed))
        assert len(set(kept)) == 1, f"per-step accounting drifts across identical steps: {kept}"
    finally:
        sac.close()


def _step_stats(policy: str):
    import tapesac

    model = weak_stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    try:
        with sac.step():
            loss_of(model(make_x())).backward()
        return sac.last_step
    finally:
        sac.close()


def test_kept_and_dropped_bytes() -> None:
    full = _step_stats("full")
    none = _step_stats("none")
    block_inputs = NBLK * INPUT_BYTES
    assert full.kept_bytes == block_inputs + full.opaque_bytes, (
        f"'full' keeps only block inputs ({block_inputs} B) and opaque tensors ({full.opaque_bytes} B), "
        f"got kept_bytes={full.kept_bytes}")
    assert full.dropped_bytes >= NBLK * INTERMEDIATE_BYTES, (full.dropped_bytes, NBLK * INTERMEDIATE_BYTES)
    assert none.dropped_bytes == 0 and none.dropped_tensors == 0
    assert none.kept_bytes >= block_inputs + NBLK * INTERMEDIATE_BYTES, none.kept_bytes
    assert none.kept_bytes > full.kept_bytes
    assert len(full.blocks) == NBLK
    for b in full.blocks:
        assert b.dropped_bytes >= INTERMEDIATE_BYTES, b
    # The same tensors go through the pack hook under both policies.
    assert full.saved_tensors == none.saved_tensors


@pytest.mark.parametrize("policy", ["full", "none"])
def test_micro_batches_release_memory_after_each_backward(policy: str) -> None:
    """Gradient accumulation inside one step: after a micro-batch's backward (retain_graph=False) its graph is
    gone, so tapesac must not keep that micro-batch's block inputs or intermediates until the step ends, or the
    peak grows with the number of micro-batches (without tapesac it does not)."""
    import tapesac

    model = weak_stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    try:
        with sac.step():
            for k in range(3):
                clear_refs(model)
                x = make_x()
                loss_of(model(x)).backward()
                del x
                assert alive(model, "fc1_out") == [] and alive(model, "gelu_out") == [], (
                    f"micro-batch {k}: intermediates still held after its backward: "
                    f"{alive(model, 'fc1_out') + alive(model, 'gelu_out')}")
                assert alive(model, "input") == [], (
                    f"micro-batch {k}: block inputs still held after its backward: {alive(model, 'input')}")
    finally:
        sac.close()


def test_micro_batches_release_memory_without_tapesac() -> None:
    """Positive control for the test above."""
    model = weak_stack()
    for _ in range(2):
        clear_refs(model)
        x = make_x()
        loss_of(model(x)).backward()
        del x
        assert alive(model, "fc1_out") == [] and alive(model, "gelu_out") == [] and alive(model, "input") == []


class _WatchedBlock(torch.nn.Module):
    """Two D x D weights and one watched tensor: watch(t) appends to alive_at_its_grad, when t's gradient is computed
    (once the node that saved t, t * t in the subclasses, is done), whether t's storage is still alive."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.alive_at_its_grad: list[bool] = []

    def watch(self, t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        t.register_hook(lambda g: self.alive_at_its_grad.append(not ref.expired()))
        return t


class _KeptReadByReplay(_WatchedBlock):
    """h = x @ w1 is saved twice by h * h; p.tanh() (saved twice: by tanh and by the next mm) is rebuilt from h."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.watch(x @ self.w1)  # its gradient: once h * h's node is done, before the first matmul's
        return (h * h).tanh() @ self.w2


def _step_watching_one_tensor(block: torch.nn.Module, policy: Any, graph: bool = False) -> Any:
    """One training step of M.Stack([block]) — plain autograd when `policy` is None, else under TapeSAC(policy), after
    three warm-up steps (capture, then launches) with the emulated graph backend when `graph` — checked bitwise
    against a deep copy run without tapesac. The block appends to `alive_at_its_grad`, from a gradient hook, whether
    the tensor it watches was still alive: it must not be (freed with the node that saved it, as without tapesac).
    Returns the step's StepStats (None for plain autograd)."""
    import tapesac

    model = M.Stack([block])
    ref = copy.deepcopy(model)
    x = make_x().requires_grad_(True)
    st = None
    if policy is None:  # positive control: plain autograd
        loss_of(model(x)).backward()
    else:
        backend = {"backend": "emulated_graph"} if graph else {}
        sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy, **backend)
        try:
            for _ in range(3 if graph else 0):
                with sac.step():
                    loss_of(model(make_x())).backward()
                model.zero_grad(set_to_none=True)
            model.blocks[0].alive_at_its_grad.clear()
            with sac.step():
                loss_of(model(x)).backward()
            st = sac.last_step
        finally:
            sac.close()
        if graph:
            assert st.graph_replays > 0, st
    assert model.blocks[0].alive_at_its_grad == [False], f"policy {policy}: still held after its node's backward"
    xr = make_x().requires_grad_(True)
    loss_of(ref(xr)).backward()
    assert_same_grads(model, ref)
    assert_same_tensor("input grad", x.grad, xr.grad)
    return st


@pytest.mark.parametrize("policy", ["none", "keep_mm", "keep_mm_graph", None])
def test_a_kept_value_a_replay_read_is_freed_with_its_last_slot(policy: str | None) -> None:
    """Note [Kept values freed with their slots] (replay/src/block_call.cpp): the block keeps h (policy: the outputs
    of aten::mm) and rebuilds tanh(h * h) from it. Once that replay is over, h is freed when the node that saved it
    (h * h) is done, as without tapesac, not when the block's last saved tensor goes: the gradient hook of h, which
    runs once h * h's node is done (before the first matmul's backward), finds h's storage gone. (Held to the
    block's end, a kept value the replays had read raised the measured peak of policy "full" and the keep-everything
    ceiling read from it: random program 2314 at its no-checkpoint peak dropped values.) Eager and the emulated
    graph backend."""
    st = _step_watching_one_tensor(_KeptReadByReplay(), None if policy is None else "none" if policy == "none"
                                   else {"aten::mm"}, graph=policy == "keep_mm_graph")
    if policy not in (None, "none"):
        assert st.dropped_tensors >= 2 and st.ops_replayed >= 2 and st.kept_tensors >= 2, st


class _ExternalTimesTwo(torch.autograd.Function):
    """2 * h computed where the dispatcher does not see it: the output comes from torch.empty_like and is filled
    through .numpy() (opaque to tapesac: kept, never replayed). It saves nothing for its own backward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(h)
        out.numpy()[...] = 2 * h.detach().numpy()
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return 2 * g


class _ExternalReadByReplay(_WatchedBlock):
    """e = external(x @ w1) and a wrapped Python number read by (e * e * 0.5).tanh() @ w2: under policy "full" the
    replay of the tanh output reads e (kept, opaque) and the number."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.watch(_ExternalTimesTwo.apply(x @ self.w1))  # its gradient: once e * e's node is done
        return (e * e * 0.5).tanh() @ self.w2


@pytest.mark.parametrize("policy", ["none", "full", "full_graph", None])
def test_an_external_a_replay_read_is_freed_with_its_readers(policy: str | None) -> None:
    """Note [Externals freed with their readers] (replay/src/block_call.cpp): the replay of tanh(e * e * 0.5) reads
    e, the output of a kernel that wrote outside the dispatcher (no recorded op produced its bytes: an external of
    the tape). Once no replay can read it, e is freed when the node that saved it (e * e) is done, as without
    tapesac, not when the block's last saved tensor goes: e's gradient hook, which runs once that node is done,
    finds e's storage gone. (Held to the block's end, such externals raised the measured peak of policy "full" and
    the keep-everything ceiling read from it: random program 1336 at its no-checkpoint peak dropped values.) Eager
    and the emulated graph backend."""
    st = _step_watching_one_tensor(_ExternalReadByReplay(), None if policy is None else "none" if policy == "none"
                                   else "full", graph=policy == "full_graph")
    if policy not in (None, "none"):
        assert st.dropped_tensors >= 2 and st.ops_replayed >= 2 and st.opaque_tensors >= 1, st


class _TwoBranches(torch.nn.Module):
    """h = x @ w1, kept, saved only by h * h (branch 1); both branches' tanh outputs are rebuilt from h. Branch 2
    starts from h.detach(): its backward reaches only w2 (without it, the second backward would need the first
    matmul's node, which the first backward freed, in plain PyTorch too)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ self.w1
        return (h * h).tanh().sum(), h.detach().tanh() @ self.w2


@pytest.mark.parametrize("use_tapesac", [True, False])
def test_a_kept_value_stays_for_a_retained_branch_after_the_other_branch_freed_its_node(use_tapesac: bool) -> None:
    """Note [Kept values freed with their slots]: the first backward (branch 1, not retained) replays both branches'
    dropped values and frees h * h's node, the only one that saved h; branch 2 then runs backward twice
    (retain_graph=True first), and its second round replays h.tanh() from h again. A kept value is let go of only
    when no dropped value reading it has a handle left, so h is still there: bitwise the plain run's gradients."""
    import tapesac

    def step(model: torch.nn.Module, x: torch.Tensor) -> None:
        y1, y2 = model(x)
        y1.backward()
        loss_of(y2).backward(retain_graph=True)
        loss_of(y2).backward()

    model = M.Stack([_TwoBranches()])
    ref = copy.deepcopy(model)
    x = make_x().requires_grad_(True)
    if use_tapesac:
        sac = tapesac.TapeSAC(model, blocks="blocks.*", policy={"aten::mm"})
        try:
            with sac.step():
                step(model, x)
            st = sac.last_step
        finally:
            sac.close()
        assert st.dropped_tensors >= 2 and st.replays >= 2, st  # both rounds replayed
    else:
        step(model, x)
    xr = make_x().requires_grad_(True)
    step(ref, xr)
    assert_same_grads(model, ref)
    assert_same_tensor("input grad", x.grad, xr.grad)


class _StashedSaved(torch.nn.Module):
    """h = sin(x @ w1), saved by h * h and by tanh's input chain; optionally stored on the module (alive)."""

    def __init__(self, stash: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.stash = stash
        self.stored: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.w1).sin()
        if self.stash:
            self.stored = h
        return (h * h).tanh() @ self.w2


@pytest.mark.parametrize("stash", [False, True])
def test_a_dropped_value_alive_elsewhere_is_not_rebuilt(stash: bool) -> None:
    """Note [Targets alive elsewhere] (replay/src/block_call_schedule.cpp): the first unpack replays the block's
    dropped values, but h, stored on the module, is alive: its unpack serves it as it is, so it is not rebuilt (a
    copy would be held beside it until h * h's backward, on top of the step peak). Gradients bitwise the plain
    run's."""
    import tapesac

    def run(stash_run: bool) -> tuple[torch.nn.Module, Any]:
        model = M.Stack([_StashedSaved(stash_run)])
        sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
        try:
            with sac.step():
                loss_of(model(make_x())).backward()
            return model, sac.last_step
        finally:
            sac.close()

    model, st = run(stash)
    _, without = run(False)
    h_bytes = ROWS * D * FP32
    assert st.ops_replayed > 0, st
    # Measured: the stash adds 262,144 bytes to the step peak; with a rebuilt copy of h held beside it, 524,288.
    extra = st.memory.peak_bytes - without.memory.peak_bytes
    assert (extra < h_bytes) if stash else (extra == 0), (st.memory.peak_bytes, without.memory.peak_bytes)
    ref = M.Stack([_StashedSaved(stash)])
    loss_of(ref(make_x())).backward()
    assert_same_grads(model, ref)
