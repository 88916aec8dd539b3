"""The hooks of one step: a forward pre-hook and post-hook on every block, installed by ``sac.step()`` and removed
in its ``finally``. The pre-hook opens a block call in the C++ session and enters the saved-tensor hooks whose
pack/unpack are C++ functions; the post-hook closes them. Blocks nested in an open block record into it.

Hooks act only on the step's thread (the one that called ``install()``): module hooks fire on every thread that runs
the model, while the recorder, the saved-tensor hooks and the session's open block are the step's own. Another
thread's block calls run untouched (see Note [other threads]). Block calls under a torch.func transform run untouched
too (see Note [torch.func]).

Note [other threads]: a pre-hook on another thread would open the step's block call from there, push saved-tensor hooks
onto that thread's stack and let the step's post-hook pop them from the wrong thread (PyTorch's assert in
SavedTensorHooks.cpp, heap corruption); and the step would count and record another thread's calls.

Note [A block that calls itself]: a block may call itself (a recursive module; user hooks that call the block again).
The inner call's pre-hook opens nothing (a block call is open), so its post-hook must not close the outer call: it
closed it and popped the top of the saved-tensor hook stack — the user's pair when the inner call ran inside the
user's saved_tensors_hooks — and the block's later saves skipped the user's hooks (an adversarial test: gradients off
by 3.3e-3 under every policy). Calls the open block makes of itself are counted and their post-hooks pass.

Note [torch.func]: grad, vjp, jacrev and hessian disable saved-tensor hooks while they run (pushing ours raises
PyTorch's untyped "don't yet support saved tensor hooks"), and under vmap / jvp the tensors are functorch wrappers a
replay outside the transform cannot rebuild. So a block call made while a transform is active is not recorded: its
tensors are saved by autograd as usual (kept), and the step counts it (`StepHooks.aside_calls`).
"""

from __future__ import annotations

from typing import Any, Sequence

import sys
import threading
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .inert import Inert

__all__ = ["StepHooks"]


# torch's C functions, looked up once: the hooks run at every block call (issue 20: the cost per block call).
# `_push_hooks`/`_pop_hooks` are what torch.autograd.graph.saved_tensors_hooks' __enter__/__exit__ call.
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_peek_interpreter = torch._C._functorch.peek_interpreter_stack
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled
# Note [Hooks of others]. A block whose forward starts under someone else's saved-tensor hooks (the user's
# saved_tensors_hooks, save_on_cpu, torch.utils.checkpoint with use_reentrant=False around it) runs under them,
# untouched: only the innermost hooks apply, so tapesac's pushed on top replaced them for the block's tensors —
# a lossy or counting pair of hooks around the forward silently saw none of them (gradients differed from plain
# PyTorch under every policy, "none" included: an adversarial test). Counted in aside_calls, warned once (conflicts).
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _foreign_hooks() -> bool:
    """Saved-tensor hooks on top that are not a tapesac session's (Note [Hooks of others])."""
    top = _top_hooks(False)
    return top is not None and getattr(top[0], "__name__", "") != "tapesac_pack"


def _exception_in_flight() -> bool:
    """An exception is being handled: an always-called forward hook runs inside the module call's `except`."""
    return sys.exc_info()[1] is not None


_grad_enabled = torch.is_grad_enabled
_thread_id = threading.get_ident


def _functorch_active() -> bool:
    """True while a torch.func transform runs on this thread (Note [torch.func])."""
    return _peek_interpreter() is not None or not _hooks_enabled()


class StepHooks:
    """Block hooks of one TapeSAC; `install()` for a step, `remove()` after it (idempotent, also after errors)."""

    def __init__(self, session: Any, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        self._session = session
        self._blocks = list(blocks)
        self._handles: list[Any] = []
        # The blocks whose call is open, innermost last, each with the frame that called its pre-hook (torch's module
        # call: Note [A block call a BaseException left open]).
        self._open: list[tuple[nn.Module, Any]] = []
        self._reentered = 0  # calls of the open block made from inside it (Note [A block that calls itself])
        self._installed = 0  # install() count: hooks of an earlier install that a module call still runs are stale
        self._thread: int | None = None
        self._pack, self._unpack = session.saved_tensor_hooks()  # C functions (Note [Hooks without pybind11])
        self.aside_calls = 0  # block calls of this step run untouched under a torch.func transform

    def install(self) -> None:
        """Installs the hooks for a step on the calling thread (the step's thread: the only one they act on)."""
        self._thread = threading.get_ident()
        self.aside_calls = 0
        self._installed += 1
        for name, module in self._blocks:
            _add_block_hooks(module, _PreHook(self, name, self._installed), _PostHook(self, module), self._handles)

    def remove(self) -> None:
        """Removes the hooks and closes every open block call (also if closing one raises). A module call that
        gathered them before still runs them: with no step thread they pass (sac.close() in a pre-hook that ran before
        tapesac's opened a block call of the closed session, and its recorder stayed active on the thread).

        Note [Hooks removed whatever interrupts]. A KeyboardInterrupt (or a signal handler's exception) lands between
        any two bytecodes: each handle leaves `_handles` only after it removed its hooks (removing twice is harmless),
        and the step's saved-tensor hooks are taken off the thread's stack even when no open block records them
        (an interrupt between a pre-hook's push and its bookkeeping; adversarial tests). Interrupted itself, it can be
        called again: the step's end does so once (core.py)."""
        self._thread = None
        handles = self._handles
        while handles:
            handles[-1].remove()
            handles.pop()
        try:
            self.close_open_blocks()
        finally:
            _pop_own(self._pack, every=True)

    def open_block(self, name: str, module: nn.Module, caller: Any) -> None:
        """Opens `module`'s block call now, for a step that starts inside that block's forward pre-hooks
        (sac.attach): torch gathered the call's pre-hooks before install() added this block's. `caller`: the frame that
        called the pre-hook that starts the step (torch's module call; Note [A block call a BaseException left
        open])."""
        _PreHook(self, name, self._installed).open_call(module, caller)

    def close_open_blocks(self) -> None:
        while self._open:
            self._close_top_block()
        self._session.end_block()

    def _close_top_block(self, aborted: bool = False) -> None:
        """Pops the innermost open block's saved-tensor hooks and closes its block call (also if popping raises).
        The hooks go first: interrupted before `_open` lets go of the block, a later close finds the block still
        open and pops nothing more (Note [Hooks removed whatever interrupts])."""
        try:
            _pop_own(self._pack)
        finally:
            self._reentered = 0
            if self._open:
                self._open.pop()
            self._session.end_block(aborted)

    def _close_unwound(self) -> None:
        """Note [A block call a BaseException left open]. torch runs always-called forward hooks for an Exception
        only: a KeyboardInterrupt (or SystemExit, a signal handler's exception) raised in a block's forward leaves its
        block call open and its saved-tensor hooks pushed. Caught by the loop inside the step (sac.attach: the step
        lasts to optimizer.step()), the next forward's block calls then ran as calls of that stale one — recorded into
        it or skipped, the iteration kept everything (an adversarial test). A block call whose module call is no
        longer on this thread's stack is closed here, as a forward that raised, before the next one opens."""
        live = set()
        f = sys._getframe(1)
        while f is not None:
            live.add(id(f))
            f = f.f_back
        while self._open and id(self._open[-1][1]) not in live:
            self._close_top_block(aborted=True)


class _PreHook:
    """A step's forward pre-hook on one block (with kwargs): opens the block call and pushes the saved-tensor hooks.
    A deep copy or a pickle of it is an Inert (inert.py: a copied model must not act on this TapeSAC). One object
    per block per step, called directly by torch (no wrapper): the hooks run at every block call (issue 20)."""

    __slots__ = ("hooks", "name", "installed")

    def __init__(self, hooks: StepHooks, name: str, installed: int) -> None:
        self.hooks = hooks
        self.name = name
        self.installed = installed

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (Inert, ())

    def __call__(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        # kwargs optional: a call whose hooks torch gathered before this step re-installed them runs this hook as a
        # plain one (sac.attach ending a failed step in the same forward pre-hooks)
        return self.open_call(module, sys._getframe(1))

    def open_call(self, module: nn.Module, caller: Any) -> None:
        """The pre-hook's work; `caller` is the frame that called the hook (torch's module call)."""
        h = self.hooks
        if _thread_id() != h._thread:  # Note [other threads]
            return None
        if self.installed != h._installed:
            # A hook of an earlier step that this module call gathered before sac.attach ended that step and started
            # another in its first pre-hook: the new step opened the call already (open_block). Counted as a call of
            # the open block made from inside it, it kept the block call open past its forward.
            return None
        if h._open:
            h._close_unwound()  # Note [A block call a BaseException left open]
        if h._open and h._open[-1][0] is module:  # Note [A block that calls itself]
            h._reentered += 1
            return None
        session = h._session
        if not _grad_enabled() or session.block_open:
            return None
        if _functorch_active() or _foreign_hooks():  # Note [torch.func], Note [Hooks of others]
            h.aside_calls += 1
            return None
        if session.begin_block(self.name):
            h._open.append((module, caller))  # before the push: an interrupt between them leaves nothing unrecorded
            _push_hooks(h._pack, h._unpack)  # saved_tensors_hooks(pack, unpack).__enter__()
        return None


class _PostHook:
    """A step's forward hook on one block (always called): closes the block call its pre-hook opened. Copies and
    pickles are Inert, as _PreHook's."""

    __slots__ = ("hooks", "module")

    def __init__(self, hooks: StepHooks, module: nn.Module) -> None:
        self.hooks = hooks
        self.module = module

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (Inert, ())

    def __call__(self, mod: nn.Module, args: Any, output: Any) -> None:
        h = self.hooks
        if _thread_id() != h._thread:  # Note [other threads]
            return None
        if h._open and h._open[-1][0] is self.module:
            if h._reentered:  # the end of a call the open block made of itself: its own call goes on
                h._reentered -= 1
                return None
            # Called with no output while an exception is in flight: the forward raised (an always-called hook;
            # Note [A block call whose forward raised], replay/src/block_call.cpp).
            h._close_top_block(aborted=output is None and _exception_in_flight())
        return None


# Note [Block hooks without handles]. install() and remove() run at every step for every block: through
# register_forward_pre_hook / register_forward_hook they cost ~5 us per block (two RemovableHandles, each with weak
# references to three dicts; 48 blocks: 256 us a step, more than the blocks' tiny forwards in perf/bench_record.py's
# "blocks" workload). _add_block_hooks writes the entries those calls write -- the hook under a fresh RemovableHandle
# id in `_forward_pre_hooks` / `_forward_hooks`, the id in `_forward_pre_hooks_with_kwargs` /
# `_forward_hooks_always_called` -- and _DictHooks.remove() deletes them, as RemovableHandle.remove() does (~0.8 us a
# block). A module without those dicts (another torch) gets the public calls.
_DICT_TYPES = frozenset((dict, OrderedDict))
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_always_called")


class _DictHooks:
    """The two entries (pre-hook with kwargs, always-called hook) _add_block_hooks writes; remove() deletes them, from
    the dicts written and from the module's dicts of that name now (a user who replaced one inside the step)."""

    __slots__ = ("module", "dicts", "pre_id", "post_id")

    def __init__(self, module: nn.Module, dicts: list[dict[Any, Any]], pre_id: int, post_id: int) -> None:
        self.module = module
        self.dicts = dicts
        self.pre_id = pre_id
        self.post_id = post_id

    def remove(self) -> None:
        pre_hooks, pre_kwargs, post_hooks, post_always = self.dicts
        pre_hooks.pop(self.pre_id, None)
        pre_kwargs.pop(self.pre_id, None)
        post_hooks.pop(self.post_id, None)
        post_always.pop(self.post_id, None)
        now = self.module.__dict__
        if (now.get("_forward_pre_hooks") is not pre_hooks or now.get("_forward_hooks") is not post_hooks
                or now.get("_forward_pre_hooks_with_kwargs") is not pre_kwargs
                or now.get("_forward_hooks_always_called") is not post_always):
            for name, key in zip(_HOOK_DICTS, (self.pre_id, self.pre_id, self.post_id, self.post_id)):
                drop_hook_entry(self.module, name, key)


def _add_block_hooks(module: nn.Module, pre: _PreHook, post: _PostHook, handles: list[Any]) -> None:
    """Registers `pre` (a forward pre-hook with kwargs) and `post` (an always-called forward hook) on `module`, last
    in order, appending what removes them to `handles` before anything is written (Note [Block hooks without
    handles], Note [Hooks removed whatever interrupts])."""
    d = module.__dict__
    dicts = [d.get(name) for name in _HOOK_DICTS]
    t = _DICT_TYPES
    if not (type(dicts[0]) in t and type(dicts[1]) in t and type(dicts[2]) in t and type(dicts[3]) in t):
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, always_call=True))
        return
    pre_id = RemovableHandle.next_id
    RemovableHandle.next_id = pre_id + 2  # ids torch hands out: unique among every module's hooks
    handles.append(_DictHooks(module, dicts, pre_id, pre_id + 1))
    dicts[0][pre_id] = pre
    dicts[1][pre_id] = True
    dicts[2][pre_id + 1] = post
    dicts[3][pre_id + 1] = True


def _pop_own(pack: Any, every: bool = False) -> None:
    """Pops the saved-tensor hooks whose pack is `pack` (the step's) off the stack: the innermost such pair, or with
    `every` all of them (Note [Hooks removed whatever interrupts]). The pairs above it are lifted off and put back in
    their order: a block whose forward entered saved_tensors_hooks of its own and never exited them left them on top,
    and they stay as its code left them (as they would without tapesac) — popping the top took the user's pair and
    left tapesac's on the stack after the step. One call when the stack is empty."""
    lifted = []
    try:
        while (top := _top_hooks(True)) is not None:
            if top[0] is not pack:
                lifted.append(top)  # before the pop: an interrupt between them leaves no pair lost
                _pop_hooks()
                continue
            _pop_hooks()
            if not every:
                break
    finally:
        for pair in reversed(lifted):
            _push_hooks(*pair)


def drop_hook_entry(module: nn.Module, dict_name: str, key: Any) -> None:
    """Deletes `key` from the module's hook dict `dict_name` as it is now (a dict the user replaced inside the step
    holds the entry too: a handle holds the dict of registration). No-op when absent."""
    current = module.__dict__.get(dict_name)
    if isinstance(current, dict):
        current.pop(key, None)
