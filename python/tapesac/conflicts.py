"""Conflict detection: the setups in which tapesac would silently do nothing, or something other than asked, are
warned once each through the ``tapesac`` logger (log.py), and every warning says what to do.

Contract (one ``Conflicts`` per TapeSAC; it only reads the model and never changes what a block computes):
- At construction: blocks compiled with torch.compile (kept, exact, nothing saved), the model or a module around
  the blocks compiled in place (``module.compile()``), blocks already checkpointed by Hugging Face
  (``gradient_checkpointing_enable()``), and a second live TapeSAC on a model or block that one already records.
- Before every step (until each has been warned): the same in-place checks again, since a trainer turns HF's
  checkpointing on when training starts, after the TapeSAC was made.
- During the first ``CHECKED_STEPS`` steps, per block forward (a forward pre-hook installed for those steps only):
  the block runs inside someone else's saved-tensor hooks (``torch.utils.checkpoint`` with ``use_reentrant=False``,
  ``save_on_cpu``) or inside a backward (the recomputation of ``torch.utils.checkpoint`` with ``use_reentrant=True``).
- After every step: no block call recorded (the usual cause: ``torch.compile(model)`` compiled before the first step,
  whose compiled code ignores hooks added later), or nothing dropped because most saved tensors were opaque (compiled
  kernels the recorder cannot see) — reported only when no specific conflict explains it.
- Outside steps: a post-accumulate-grad hook on one trainable parameter of every block notices a block whose
  backward ran outside any step (it trained without tapesac). It is the one hook that stays between steps, and it
  is on a parameter, not on the module: a module's forward hooks are visible state (nn.TransformerEncoderLayer leaves
  its inference fast path when its modules have any, torch.jit.script compiles them, a deep copy carries them), and
  a parameter's grad hooks are neither deep-copied nor pickled. It is removed at the next step after its warning and
  at ``close()``. A block without trainable parameters is not watched.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import nn

from .blocks import is_compiled
from .hooks import drop_hook_entry
from .log import Once

__all__ = ["Conflicts", "CHECKED_STEPS"]

# Steps whose block forwards are checked for someone else's checkpoint around the block: a setup, not something
# that changes mid-training, and a hook per block call costs a few microseconds.
CHECKED_STEPS = 3

# Every module a live TapeSAC records (its model and its blocks) -> that TapeSAC's Conflicts (weakly on both sides).
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[Conflicts]]" = weakref.WeakKeyDictionary()


def remove_handles(*handle_lists: list[Any]) -> None:
    """Removes the hooks in `handle_lists` and empties them. A TapeSAC's finalizer calls it with the lists of its
    Conflicts (`handle_lists()`). Note [A finalizer that holds no model]: hook handles refer to the hook dicts weakly,
    so the finalizer keeps no module alive; it held Conflicts.close, hence the model, and a model in a reference cycle
    outlived the first collection after it became unreachable, closed or not."""
    for handles in handle_lists:
        for h in handles:
            h.remove()
        handles.clear()


class _PreHookHandle:
    """A forward pre-hook's handle that also finds the hook in the module's dict of now: a dict the user replaced
    inside the step (`m._forward_pre_hooks = OrderedDict(...)`) kept it with torch's handle alone, which holds the old
    dict. The module is held weakly (Note [A finalizer that holds no model])."""

    __slots__ = ("handle", "module")

    def __init__(self, module: nn.Module, handle: Any) -> None:
        self.handle = handle
        self.module = weakref.ref(module)

    def remove(self) -> None:
        self.handle.remove()
        m = self.module()
        if m is not None:
            drop_hook_entry(m, "_forward_pre_hooks", self.handle.id)


def _names(names: Sequence[str]) -> str:
    return f"{list(names[:4])}{' and %d more' % (len(names) - 4) if len(names) > 4 else ''}"


class _Inert:
    """What a pickled or deep-copied model holds in place of a watch hook: nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Hook:
    """A watch hook bound weakly to its Conflicts (the hook never keeps a TapeSAC alive)."""

    def __init__(self, owner: "Conflicts", method: str, name: str) -> None:
        self._owner = weakref.ref(owner)
        self._method = method
        self._name = name

    def __call__(self, module: nn.Module, *args: Any) -> None:
        if torch.compiler.is_compiling():
            return None  # traced by torch.compile: no Python runs per call, and no graph break
        owner = self._owner()
        if owner is not None:
            getattr(owner, self._method)(self._name, module, *args)
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_Inert, ())


class _GradWatch:
    """The between-steps watch of one block: a post-accumulate-grad hook on one of its trainable parameters, bound
    weakly to its Conflicts (it never keeps a TapeSAC alive)."""

    def __init__(self, owner: "Conflicts", name: str) -> None:
        self._owner = weakref.ref(owner)
        self._name = name

    def __call__(self, param: torch.Tensor) -> None:
        owner = self._owner()
        if owner is not None:
            owner._trained_outside(self._name)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_Inert, ())


def _watch(owner: "Conflicts", name: str, block: nn.Module) -> Any:
    """The watch hook's handle on `block`'s first trainable parameter; None when it has none. A lazy module's
    parameters (nn.LazyLinear before its first forward) take no hook: torch raised a ValueError for them from
    TapeSAC(...) (a helper's finding); such a block is watched once they exist (Conflicts.after_step)."""
    for p in block.parameters():
        if p.requires_grad and p.is_leaf and not nn.parameter.is_lazy(p):
            return p.register_post_accumulate_grad_hook(_GradWatch(owner, name))
    return None


_ABSENT = object()


def _module_attr(module: nn.Module, name: str) -> Any:
    """getattr(module, name, None) without nn.Module.__getattr__, which raises (and formats) an AttributeError for a
    name a module does not have: once per block per step in check_modules, 140 us a step on 48 blocks (issue 20). The
    lookup getattr makes, in its order: a data descriptor of the class (a property), the instance's dict, another
    class attribute, then what nn.Module.__getattr__ finds (parameters, buffers, submodules). A class with a
    __getattr__ of its own (torch.compile's OptimizedModule, wrappers that forward to a wrapped module) gets getattr."""
    cls = type(module)
    if cls.__getattr__ is not _MODULE_GETATTR:
        return getattr(module, name, None)
    v = getattr(cls, name, _ABSENT)
    if v is not _ABSENT and (hasattr(v, "__set__") or hasattr(v, "__delete__")):
        return getattr(module, name, None)
    d = module.__dict__
    if name in d:
        return d[name]
    if v is not _ABSENT:
        return getattr(module, name, None) if hasattr(v, "__get__") else v
    for table in ("_parameters", "_buffers", "_modules"):
        if name in d.get(table, ()):
            return d[table][name]
    return None


_MODULE_GETATTR = nn.Module.__getattr__


class Conflicts:
    """The conflict checks of one TapeSAC (see the module's contract)."""

    def __init__(self, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], session: Any) -> None:
        self._model = model
        self._blocks = list(blocks)
        self._session = session
        self._once = Once()
        self.closed = False
        self.in_step = False
        self._step_warned = False  # a specific conflict was warned during the current step
        # The blocks and every module around them: where HF's flag and an in-place compile are looked for.
        around: dict[int, tuple[str, nn.Module]] = {id(model): ("", model)}
        for name, _ in self._blocks:
            parts = name.split(".")
            for i in range(1, len(parts)):
                prefix = ".".join(parts[:i])
                mod = model.get_submodule(prefix)
                around.setdefault(id(mod), (prefix, mod))
        self._around = list(around.values())
        self._check_compiled_blocks()
        self._check_second_tapesac()
        self.check_modules()
        for m in [model] + [m for _, m in self._blocks]:
            _OWNERS[m] = weakref.ref(self)
        self._steps = 0
        self._step_handles: list[Any] = []
        self._watched = False  # the watch warned: its hooks go at the next step (not from inside the backward)
        self._handles: list[Any] = []
        # Blocks not watched yet: every block here, then those without an initialised trainable parameter (lazy).
        self._unwatched: list[tuple[str, nn.Module]] = list(self._blocks)
        try:
            self._watch_initialised()
        except BaseException:
            remove_handles(self._handles)  # nothing left behind by a constructor that fails
            raise

    # -- at construction ------------------------------------------------------------------------------------------
    def _check_compiled_blocks(self) -> None:
        compiled = [n for n, m in self._blocks if is_compiled(m)]
        if compiled:
            self._once.warning("compiled-blocks", (
                f"tapesac: block(s) {_names(compiled)} are torch.compile'd: a compiled forward runs as one opaque graph "
                f"that tapesac cannot replay, so everything it saves is kept (exact, but no memory is saved). Apply "
                f"tapesac to the uncompiled blocks (compile submodules inside them, or other parts of the model) to "
                f"checkpoint them."))

    def _check_second_tapesac(self) -> None:
        for m in [self._model] + [m for _, m in self._blocks]:
            ref = _OWNERS.get(m)
            other = ref() if ref is not None else None
            if other is not None and other is not self and not other.closed:
                self._once.warning("second", (
                    f"tapesac: {type(m).__name__} is already recorded by another TapeSAC that is still open: two "
                    f"TapeSACs on one model record the same blocks, and only one can run a step at a time (the other "
                    f"one's blocks then train without it). Use one TapeSAC per model: call close() on the old one "
                    f"before making a new one, or keep using the old one."))
                return

    # -- before a step --------------------------------------------------------------------------------------------
    def check_modules(self) -> None:
        """HF's checkpointing flag and an in-place compile on the blocks or around them (each warned once)."""
        if not self._once.seen("hf"):
            flagged = [name or type(m).__name__ for name, m in self._around + self._blocks
                       if _module_attr(m, "gradient_checkpointing") is True]
            if flagged:
                self._step_warned = True
                self._once.warning("hf", (
                    f"tapesac: Hugging Face gradient checkpointing is on ({_names(flagged)} has gradient_checkpointing="
                    f"True: model.gradient_checkpointing_enable(), or TrainingArguments(gradient_checkpointing=True)). "
                    f"Each block's forward then runs inside torch.utils.checkpoint, which saves almost nothing for "
                    f"tapesac to choose from: tapesac records, keeps the few tensors left and saves no memory. Turn "
                    f"one off: model.gradient_checkpointing_disable() (and gradient_checkpointing=False in "
                    f"TrainingArguments) to let tapesac choose what to keep, or sac.close() to use HF's full "
                    f"checkpointing alone."))
        if not self._once.seen("compiled-model"):
            compiled = [name or type(m).__name__ for name, m in self._around if is_compiled(m)]
            if compiled:
                self._step_warned = True
                self._once.warning("compiled-model", (
                    f"tapesac: {_names(compiled)} is compiled as a whole (module.compile() or torch.compile): its "
                    f"compiled code hides the blocks from tapesac's recorder (hooks added later are not called, fused "
                    f"kernels are not recorded), so nothing is checkpointed. Compile submodules inside the blocks "
                    f"instead (e.g. block.mlp.compile()), or use tapesac without compiling the model."))

    def before_step(self) -> None:
        if self._watched:
            self._remove_hooks()
        self._step_warned = False
        self.check_modules()
        self.in_step = True
        if self._steps < CHECKED_STEPS:
            for name, m in self._blocks:
                self._step_handles.append(_PreHookHandle(
                    m, m.register_forward_pre_hook(_Hook(self, "_block_starts", name), prepend=True)))

    # -- during a step --------------------------------------------------------------------------------------------
    def _block_starts(self, name: str, module: nn.Module, args: Any) -> None:
        if not self.in_step or not torch.is_grad_enabled() or self._session is None or self._session.block_open:
            return
        if torch._C._current_graph_task_id() != -1:
            if not self._once.seen("hooks") and not self._once.seen("inside-backward"):
                self._step_warned = True
                self._once.warning("inside-backward", (
                    f"tapesac: block {name} ran its forward inside a backward pass: something else recomputes it "
                    f"(torch.utils.checkpoint around the block; with use_reentrant=True its first forward ran without "
                    f"gradients, so tapesac had nothing to record). Remove that checkpoint around the block and let "
                    f"tapesac choose what to keep."))
        elif torch._C._autograd._top_saved_tensors_default_hooks(False) is not None and not self._once.seen("hooks"):
            self._step_warned = True
            self._once.warning("hooks", (
                f"tapesac: block {name} runs inside saved-tensor hooks that are not tapesac's (torch.utils.checkpoint "
                f"with use_reentrant=False around the block, torch.autograd.graph.save_on_cpu, your own "
                f"saved_tensors_hooks): tapesac leaves such blocks to those hooks (records and drops nothing there). "
                f"Remove that checkpoint or offload around the block to let tapesac choose what to keep."))

    # -- outside steps --------------------------------------------------------------------------------------------
    def _trained_outside(self, name: str) -> None:
        if self.in_step or self._watched or torch.compiler.is_compiling():
            return
        self._watched = True  # warned once: the watch is no longer needed (removed at the next step)
        self._once.warning("outside", (
            f"tapesac: block {name} ran forward and backward with gradients outside any step while a TapeSAC "
            f"is attached: it trained without checkpointing (every activation kept). Run forward and backward "
            f"inside `with sac.step():`, or let the optimizer delimit steps (sac.attach(optimizer)), or use a "
            f"trainer callback (tapesac.integrations); call sac.close() if tapesac should not apply."))

    # -- after a step ---------------------------------------------------------------------------------------------
    def after_step(self, stats: Any) -> None:
        self.in_step = False
        self._steps += 1
        remove_handles(self._step_handles)
        if self._unwatched and not self._watched:
            self._watch_initialised()
        if stats is None or self._step_warned:
            return
        if stats.block_calls == 0:
            self._once.warning("no-block", (
                f"tapesac: step {stats.step} recorded no block call: the blocks' forwards did not run through "
                f"tapesac's hooks, so nothing was checkpointed. Usual causes: the model runs through "
                f"torch.compile(model) compiled before the first step (its compiled code ignores hooks added later; "
                f"compile submodules inside the blocks instead, e.g. block.mlp.compile()); the forward ran outside "
                f"`with sac.step():` or under torch.no_grad(); or blocks= names modules the forward does not call "
                f"(sac.blocks lists them)."))
        elif (stats.policy != "none" and stats.saved_tensors and not stats.dropped_tensors
              and 2 * stats.opaque_tensors >= stats.saved_tensors):
            self._once.warning("opaque", (
                f"tapesac: step {stats.step} dropped nothing: {stats.opaque_tensors} of the {stats.saved_tensors} "
                f"tensors its blocks saved were made by code the recorder cannot see (opaque: kept). Usual causes: "
                f"the model or the blocks run compiled (torch.compile: fused kernels; compile submodules inside the "
                f"blocks instead), or custom kernels (Triton, CUDA extensions) make the blocks' activations."))

    def _watch_initialised(self) -> None:
        """Watches the blocks of _unwatched that have a trainable parameter now; keeps those still lazy."""
        still = []
        for name, m in self._unwatched:
            h = _watch(self, name, m)
            if h is not None:
                self._handles.append(h)
            elif any(nn.parameter.is_lazy(p) for p in m.parameters()):
                still.append((name, m))
        self._unwatched = still

    # -- closing --------------------------------------------------------------------------------------------------
    def handle_lists(self) -> tuple[list[Any], list[Any]]:
        """The lists holding this instance's hook handles, emptied in place when the hooks go (`remove_handles`)."""
        return self._handles, self._step_handles

    def _remove_hooks(self) -> None:
        remove_handles(self._handles)

    def close(self) -> None:
        remove_handles(self._handles, self._step_handles)
        self._session = None
        self.closed = True
        self.in_step = False
        for m in [self._model] + [m for _, m in self._blocks]:
            ref = _OWNERS.get(m)
            if ref is not None and ref() is self:
                del _OWNERS[m]
