"""The step-free mode: ``sac.attach(optimizer)`` delimits steps without a ``with`` block, for code that cannot wrap
its training step (trainers, callbacks, loops owned by a library).

Contract:
- A step starts at the first block forward with gradients enabled while no step is open (a forward pre-hook on each
  block, run before any other hook of the block), and ends at the next ``optimizer.step()`` (a step pre-hook on the
  optimizer), at ``end_step()``, or at ``detach()``. Everything between — forward, backward, several of each with
  gradient accumulation — is one step, exactly as inside ``with sac.step():``.
- A backward that reaches tensors saved in a step that has already ended (e.g. ``optimizer.step()`` ran between a
  forward and its backward) raises TapeSACError naming the block: a backward cannot span two steps.
- Forwards without gradients (evaluation) start nothing. While a ``with sac.step():`` block is open the hooks stand
  aside. ``detach()`` (also ``sac.close()`` and leaving ``with sac.attach(...)``) ends an open step and removes the
  hooks; the model and the optimizer are left as they were.
- The trainer callbacks (tapesac.integrations) use this without an optimizer and call ``end_step()`` after each
  backward, which makes every micro-batch of gradient accumulation its own step.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

from .errors import ConfigError, TapeSACError
from .inert import CopiesInert
from .log import logger

__all__ = ["Attachment"]


def _steppable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step() hooks fire: a wrapper that subclasses Optimizer without running its __init__
    (accelerate's AcceleratedOptimizer) has no hook tables — register_step_pre_hook raised a bare AttributeError —
    and steps the optimizer it wraps, whose step() is the one that updates (once per accumulation cycle)."""
    seen = set()
    while not hasattr(optimizer, "_optimizer_step_pre_hooks") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(
                f"attach(optimizer): {type(optimizer).__name__} is a torch.optim.Optimizer that was not initialised as "
                f"one (no step hooks) and wraps no optimizer in `.optimizer`; pass the torch optimizer it steps, or "
                f"None and call end_step() after each step")
        optimizer = inner
    return optimizer


class Attachment:
    """The handle ``sac.attach(optimizer)`` returns: steps start at the first block forward and end at
    ``optimizer.step()`` (or ``end_step()``). Also a context manager that detaches on exit."""

    def __init__(self, sac: Any, optimizer: torch.optim.Optimizer | None = None) -> None:
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"attach(optimizer): expected a torch.optim.Optimizer (or None to end steps with "
                              f"end_step()), got {type(optimizer).__name__}")
        self._sac = sac
        self._step: Any = None  # the open step's context manager
        self._first: str | None = None  # the block whose forward started the open step, and its forwards since
        self._passes = 0
        self._handles: list[Any] = []
        try:
            if optimizer is not None:
                # Weakly: an optimizer that outlives a TapeSAC dropped without close() (held by an LR scheduler)
                # kept it, its model and the counting allocator alive for good (an adversarial test).
                owner = weakref.ref(self)

                def ends(opt: Any, args: Any, kwargs: Any) -> None:
                    attachment = owner()
                    if attachment is not None:
                        attachment.end_step()

                self._handles.append(_steppable(optimizer).register_step_pre_hook(CopiesInert(ends)))
            for name, module in sac.blocks:
                # A copy of the model (deepcopy, pickle) gets inert hooks: it must not start this TapeSAC's steps.
                self._handles.append(module.register_forward_pre_hook(CopiesInert(self._starter(name)), prepend=True))
        except BaseException:
            self.detach()  # nothing is left behind by an attach that failed
            raise

    @property
    def step_open(self) -> bool:
        """True between the first block forward of a step and its end."""
        return self._step is not None

    def _starter(self, name: str) -> Any:
        def start(module: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return None
            if self._step is not None:
                session = self._sac._session
                if session.backward_failed:
                    self._end_failed()  # the last backward raised in tapesac (the loop skipped that batch): start afresh
                elif session.forwards_died():
                    # Note [Forwards whose graph died] (replay/src/session.cpp): the step's forwards trained nothing;
                    # it ends here (a step in the history, without backward) and this forward starts a new one.
                    self._end_failed("the step's forwards were never backwarded")
                else:
                    self._count_pass(name)
                    return None
            if self._sac.in_step:
                return None  # a `with sac.step():` block is open: it owns this forward
            step = self._sac.step()
            step.__enter__()
            self._step = step
            self._first, self._passes = name, 1
            # The block's own hooks were installed by the step just now, after this call's hooks were gathered:
            # open its block call here so that this forward is recorded too.
            self._sac._hooks.open_block(name, module, sys._getframe(2))  # torch's frame: it called CopiesInert(start)
            return None

        return start

    def _count_pass(self, name: str) -> None:
        """Note [An attached step that never ends]: forward passes joining one attached step (its first block's
        forwards) are counted; at 64 a warning says that nothing ends the step. Without an optimizer (attach()) or
        after a trainer that raised left its attachment, every later pass joined one step that held every block
        call's records: +187 MiB over 1,000 iterations of a 27k-parameter model, in silence (an adversarial test)."""
        if name != self._first:
            return
        self._passes += 1
        if self._passes == 64:
            logger.warning(
                "tapesac: the attached step (sac.attach) has joined 64 forward passes and has not ended: it ends at "
                "the optimizer.step() it hooked or at attachment.end_step(), and until then it keeps every block "
                "call's records (memory grows). Attach the optimizer, call attachment.end_step() after each "
                "backward, or detach() (a trainer that raised leaves its attachment: sac.close() ends it).")

    def end_step(self) -> None:
        """Ends the open step (nothing when none is open); a step's error (e.g. MemoryLimitError) is raised here. A
        step whose backward already raised in tapesac ends as failed, raising nothing again."""
        if self._step is not None and self._sac._session.backward_failed:
            self._end_failed()
            return
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

    def _end_failed(self, why: str = "the step's backward failed") -> None:
        """Ends the open step as failed, as when an exception leaves ``with sac.step():`` (its statistics are not
        collected, nothing is raised). Found by an adversarial test: after a MemoryLimitError in an attached step's
        backward, a loop that skipped the batch merged the next one into the failed step, whose optimizer.step()
        raised the error again, and sac.memory_limit could not be set."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(TapeSACError, TapeSACError(why), None)

    def abandon(self) -> None:
        """Detaches after a failure: an open step ends as failed (as when an exception leaves ``with sac.step():``;
        its statistics are not collected, nothing is raised) and the hooks are removed."""
        try:
            self._end_failed()
        finally:
            self.detach()

    def detach(self) -> None:
        """Ends an open step and removes the hooks from the blocks and the optimizer."""
        try:
            self.end_step()
        finally:
            handles, self._handles = self._handles, []
            for h in handles:
                h.remove()
            if self._sac._attachment is self:
                self._sac._attachment = None

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"Attachment(step_open={self.step_open}, attached={self.attached})"


def check_not_attached(sac: Any) -> None:
    """attach() twice is a user error: one attachment delimits the steps."""
    if sac._attachment is not None:
        raise TapeSACError("this TapeSAC is already attached (sac.attach(...) was called before); call detach() on "
                           "the attachment first")


def nesting_message(active: Any, same: str) -> str:
    """The error of a step entered while a step of `active` is open on this thread: an attached step (sac.attach)
    is named as such (an adversarial test: after an HF train() that raised left its attachment, the message blamed a
    `with sac.step():` block the user never opened)."""
    head = f"sac.step() entered while a step of {same} TapeSAC is open on this thread; steps cannot nest. "
    attachment = getattr(active, "_attachment", None)
    if attachment is not None and attachment.step_open:
        return head + ("The open step is that TapeSAC's attached step (sac.attach(...)), which ends at the "
                       "optimizer.step() it hooked or at attachment.end_step(); call attachment.detach() (or "
                       "sac.close()) before using `with sac.step():`, or use one of the two only.")
    return head + ("Finish the open `with sac.step():` block first (a trainer callback must exit each step it enters, "
                   "after its backward: tapesac.integrations has callbacks for HF Trainer and Lightning, and "
                   "sac.attach(optimizer) delimits steps without a `with` block).")

