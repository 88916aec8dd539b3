"""The step-free mode (sac.attach(optimizer)) and abandoned step contexts.

A step starts at the first block forward with gradients and ends at optimizer.step(); training is bitwise the same as
without tapesac, gradient accumulation makes one step, a backward that spans two steps raises, evaluation starts no
step, and detach() leaves the model as it was. A `sac.step()` context that is entered and never exited is reported
(warning when it is collected, error when another step is entered meanwhile), never silent.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import models as M
from models import stack, x_in
from conftest import assert_same_grads, assert_same_params, default_loss


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _train(model, opt, xs, accumulate: int = 1) -> list[torch.Tensor]:
    losses = []
    for i, x in enumerate(xs):
        loss = default_loss(model, (x,)) / accumulate
        loss.backward()
        losses.append(loss.detach())
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("accumulate", [1, 2])
def test_attach_steps_at_the_optimizer_and_is_exact(tapesac, accumulate: int) -> None:
    model = stack()
    ref = copy.deepcopy(model)
    xs = [x_in().detach() for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    attachment = sac.attach(opt)
    got = _train(model, opt, xs, accumulate)
    want = _train(ref, ref_opt, xs, accumulate)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert_same_params(model, ref, "after attached training")
    hist = sac.history
    # One step per optimizer step; with accumulation both micro-batches' block calls are in it.
    assert [s.step for s in hist] == list(range(1, len(xs) // accumulate + 1))
    assert all(s.block_calls == 2 * accumulate and s.dropped_tensors > 0 and s.ops_replayed > 0 for s in hist)
    assert not attachment.step_open
    sac.close()
    assert not attachment.attached


def test_attach_backward_spanning_two_steps_raises(tapesac) -> None:
    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    sac.attach(opt)
    first = default_loss(model, (x_in(),))  # step 1 starts here
    opt.step()  # ... and ends here, before its backward
    second = default_loss(model, (x_in(),))  # step 2
    with pytest.raises(tapesac.TapeSACError, match="spans two steps") as ei:
        (first + second).backward()
    assert "optimizer.step()" in str(ei.value)
    sac.close()


def test_attach_evaluation_starts_no_step_and_with_step_still_works(tapesac) -> None:
    model = stack()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    attachment = sac.attach(opt)
    with torch.no_grad():
        model(x_in())
    assert not attachment.step_open and sac.last_step is None
    x = x_in().detach()
    with sac.step():  # an explicit step while attached: the attachment stands aside
        default_loss(model, (x,)).backward()
    default_loss(ref, (x,)).backward()
    assert_same_grads(model, ref)
    assert not attachment.step_open and sac.last_step.step == 1 and sac.last_step.block_calls == 2
    with pytest.raises(tapesac.TapeSACError, match="already attached"):
        sac.attach(opt)
    sac.close()


def test_attach_end_step_without_optimizer_and_detach_removes_hooks(tapesac) -> None:
    model = stack()
    before = _hooks(model)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    watched = _hooks(model)
    with sac.attach() as attachment:
        assert _hooks(model) == watched + 2  # one starter per block
        default_loss(model, (x_in(),)).backward()
        assert attachment.step_open
        attachment.end_step()
        assert not attachment.step_open and sac.last_step.block_calls == 2
        default_loss(model, (x_in(),)).backward()
    assert sac.last_step.step == 2  # leaving the `with` ended the open step
    assert _hooks(model) == watched
    sac.attach(torch.optim.SGD(model.parameters(), lr=0.1))  # attaching again after a detach is fine
    sac.close()
    assert _hooks(model) == before


def test_abandoned_step_context_is_reported(tapesac, caplog) -> None:
    model = stack()
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    x = x_in().detach()
    cm = sac.step()
    cm.__enter__()
    default_loss(model, (x,)).backward()
    # Entering another step while it is still open is an error that says what to do.
    with pytest.raises(tapesac.TapeSACError, match="steps cannot nest") as ei:
        with sac.step():
            pass
    assert "exit each step" in str(ei.value)
    with caplog.at_level("WARNING", logger="tapesac"):
        del cm
        gc.collect()
    assert any("abandoned" in r.getMessage() and r.name == "tapesac" for r in caplog.records), caplog.text
    default_loss(ref, (x,)).backward()
    assert_same_grads(model, ref)
    assert sac.last_step.step == 1 and sac.last_step.block_calls == 2
    model.zero_grad(set_to_none=True)
    with sac.step():  # the next step is clean
        default_loss(model, (x,)).backward()
    assert_same_grads(model, ref)
    sac.close()


class _UninitialisedWrapper(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer subclass that never runs Optimizer.__init__ (no hook
    tables) and steps the optimizer it wraps in `.optimizer` (here only every `every`-th call: accumulation)."""

    def __init__(self, optimizer, every: int = 1):  # noqa: super().__init__ deliberately not called
        self.optimizer, self.every, self.calls = optimizer, every, 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls % self.every == 0:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        if self.calls % self.every == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)


def test_attach_to_a_wrapped_optimizer_steps_at_the_inner_one(tapesac) -> None:
    """Found by an adversarial test with accelerate: attach(AcceleratedOptimizer) raised torch's bare AttributeError
    ('no attribute _optimizer_step_pre_hooks') and left its block hooks installed, so the next plain forward opened a
    step that never closed, even after close(). The wrapper's inner optimizer is hooked: one step per real update,
    exact; a wrapper with nothing to unwrap raises ConfigError and leaves no hook."""
    model = stack()
    ref = copy.deepcopy(model)
    before = _hooks(model)
    xs = [x_in().detach() for _ in range(4)]
    opt = _UninitialisedWrapper(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    attachment = sac.attach(opt)
    for x in xs:  # the wrapper is stepped every micro-batch, the SGD every second one
        (default_loss(model, (x,)) / 2).backward()
        opt.step()
        opt.zero_grad()
    _train(ref, ref_opt, xs, accumulate=2)
    assert_same_params(model, ref, "after attached training through a wrapper")
    assert [s.block_calls for s in sac.history] == [4, 4], [s.block_calls for s in sac.history]
    attachment.detach()

    bad = _UninitialisedWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    bad.optimizer = None
    with pytest.raises(tapesac.ConfigError, match="pass the torch optimizer it steps"):
        sac.attach(bad)
    default_loss(model, (xs[0],)).backward()  # a plain forward after the failed attach opens no step
    assert not sac.in_step
    sac.close()
    assert _hooks(model) == before, "hooks left after close()"


def test_a_copy_of_the_model_made_inside_a_step_or_while_attached_is_plain(tapesac) -> None:
    """Found by an adversarial test: copy.deepcopy(model) inside `with sac.step():` or while attached copied the step's
    and the attachment's hooks as closures over the original TapeSAC, so the copy's forward opened block calls and
    steps of the original (left its saved-tensor hooks pushed on the thread, even after close(); made the original's
    next step record nothing), and pickle.dumps(model) failed ("Can't pickle local object"). The copy gets inert hooks:
    it trains as plain PyTorch, and the original goes on exactly."""
    import pickle

    model = stack()
    ref = copy.deepcopy(model)
    x = x_in().detach()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    with sac.step():
        inside = copy.deepcopy(model)
        pickled = pickle.loads(pickle.dumps(model))
        default_loss(model, (x,)).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = sac.attach(opt)
    attached_copy = copy.deepcopy(model)
    pickle.dumps(model)
    for other in (inside, pickled, attached_copy):
        default_loss(other, (x,)).backward()  # plain PyTorch: nothing of the original's is opened
        assert not sac.in_step and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert not attachment.step_open
    attachment.detach()
    model.zero_grad(set_to_none=True)
    with sac.step():
        default_loss(model, (x,)).backward()
    assert sac.last_step.block_calls == 2 and sac.last_step.dropped_tensors > 0
    default_loss(ref, (x,)).backward()
    assert_same_grads(model, ref)
    sac.close()


def test_an_attached_step_whose_backward_raised_ends_at_the_next_forward(tapesac) -> None:
    """An adversarial test: with sac.attach(optimizer), a MemoryLimitError in a batch's backward (the loop skips that
    batch) left the step open: the next batch was merged into it and its optimizer.step() raised the error again,
    sac.memory_limit could not be set ("only between steps"), and once the TapeSAC was dropped every new one on the
    thread was refused as a nested step. The failed step now ends at the next block forward (or optimizer.step(), or
    when the limit is set), and a dropped TapeSAC does not block the thread."""
    torch.manual_seed(0)
    small, big = x_in()[:1].detach(), torch.randn(8, M.T, M.D)
    model = stack(2)
    probe = tapesac.TapeSAC(copy.deepcopy(model), blocks="blocks.*", policy="full")
    with probe.step():
        probe_model = probe._model
        probe_model(small).sum().backward()
    limit = probe.last_step.memory.peak_bytes + 4096  # fits the small batch, not the big one
    probe.close()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full", memory_limit=limit)
    sac.attach(opt)
    for x in (small, big, small):
        try:
            model(x).sum().backward()
        except tapesac.MemoryLimitError:
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    try:
        model(big).sum().backward()
    except tapesac.MemoryLimitError:
        pass
    sac.memory_limit = None  # was refused: the failed step is ended first
    assert not sac.in_step
    from tapesac import core

    assert isinstance(core._active_steps, weakref.WeakValueDictionary)  # a dropped TapeSAC does not block the thread
    sac.close()
    fresh_model = stack(2)
    fresh = tapesac.TapeSAC(fresh_model, blocks="blocks.*")
    with fresh.step():
        fresh_model(small).sum().backward()
    fresh.close()


def test_an_optimizer_outliving_a_dropped_attached_tapesac_lets_it_go(tapesac) -> None:
    """The optimizer's step hook held the attachment, hence the TapeSAC and its model, strongly: an optimizer kept by
    an LR scheduler kept a TapeSAC dropped without close() — and the process-wide counting allocator — alive for good
    (an adversarial test). It holds the attachment weakly."""
    from tapesac import _C

    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    sac.attach(opt)
    for _ in range(2):
        default_loss(model, (x_in(),)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert sac.last_step is not None and sac.last_step.dropped_tensors > 0
    gone = [weakref.ref(sac), weakref.ref(model)]
    params = [p for g in opt.param_groups for p in g["params"]]
    del sac, model
    gc.collect()
    assert [r() is None for r in gone] == [True, True]
    assert not _C.counting_allocator_installed()
    loss = sum(p.square().sum() for p in params)  # the optimizer still steps, with no tapesac left to end a step
    loss.backward()
    opt.step()
    sched.step()


def test_attached_forwards_whose_graphs_die_end_their_step(tapesac) -> None:
    """Note [Forwards whose graph died]: with attach(optimizer) a step lasts until optimizer.step(), and forwards with
    gradients whose graphs died unused (a validation loop without torch.no_grad()) all joined it: every block call's
    records stayed until the optimizer stepped (122 MiB of host memory after 600 forwards of a tiny Qwen3 in an
    adversarial test). Such a step ends at the next block forward; the training step after it is exact."""
    model = stack()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    sac.attach(opt)
    x = x_in().detach()
    for m, o in ((model, opt), (ref, ref_opt)):
        default_loss(m, (x,)).backward()
        o.step()
        o.zero_grad()
    steps = len(sac.history)
    for _ in range(30):
        default_loss(model, (x,)).item()  # gradients on, never backwarded: the graph dies
    assert len(sac.history) >= steps + 29  # each dead forward's step ended at the next forward
    assert sac.last_step.block_calls == 2 and sac.last_step.ops_replayed == 0
    for m in (model, ref):  # a forward that is backwarded joins no dead step: exact
        default_loss(m, (x,)).backward()
    opt.step()
    ref_opt.step()
    assert_same_params(model, ref)
    sac.close()


def test_an_attached_step_that_never_ends_is_warned_once(tapesac, caplog) -> None:
    """Note [An attached step that never ends] (attach.py): attach() without an optimizer and no end_step() (or an
    HF train() that raised and left its attachment) made every later forward pass join one step, memory growing
    without a word (+187 MiB over 1,000 iterations: an adversarial test). At 64 passes a warning says so, once; a
    `with sac.step():` entered then names the attached step instead of a `with` block the user never opened."""
    import logging

    model = stack()
    sac = tapesac.TapeSAC(model, blocks=model.blocks, policy="full")
    att = sac.attach()
    try:
        with caplog.at_level(logging.WARNING, logger="tapesac"):
            for i in range(70):
                default_loss(model, (x_in(),)).backward()
                if i == 62:
                    assert not [r for r in caplog.records if "has joined 64 forward passes" in r.getMessage()]
        warned = [r for r in caplog.records if "has joined 64 forward passes" in r.getMessage()]
        assert len(warned) == 1 and "attachment.end_step()" in warned[0].getMessage()
        assert att.step_open
        with pytest.raises(tapesac.TapeSACError, match="attached step"):
            with sac.step():
                pass
        att.end_step()
        assert not att.step_open and len(sac.history) == 1
    finally:
        sac.close()


def test_gradient_accumulation_under_64_passes_is_not_warned(tapesac, caplog) -> None:
    import logging

    model = stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks=model.blocks, policy="full")
    sac.attach(opt)
    try:
        with caplog.at_level(logging.WARNING, logger="tapesac"):
            for _ in range(3):
                for _ in range(40):
                    default_loss(model, (x_in(),)).backward()
                opt.step()
                opt.zero_grad()
        assert not [r for r in caplog.records if "forward passes" in r.getMessage()]
        assert len(sac.history) == 3
    finally:
        sac.close()
