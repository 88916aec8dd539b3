"""Helpers shared by the robustness tests (API fuzz, faults, dynamic shapes, threads): hook hygiene, memory
baselines, and a small plain-vs-tapesac comparison on a tiny stack.

Contract: nothing here imports tapesac at module import (tests import it lazily, as the rest of the suite does);
every check raises AssertionError with what was expected and what was found.
"""

from __future__ import annotations

import copy
import gc
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

import models as M
from conftest import assert_same_grads, assert_same_tensor

D_SMALL = 16

MODULE_HOOK_ATTRS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                     "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                     "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
GLOBAL_HOOK_ATTRS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                     "_global_forward_hooks_with_kwargs")


def hook_snapshot(model: nn.Module) -> dict:
    """Every hook dict of every submodule and the global module hooks (keys only). Between steps tapesac leaves none
    on a module (its conflict watch is on parameters; assert_no_tapesac_hooks checks it is gone after close())."""
    snap = {}
    for name, mod in model.named_modules():
        for attr in MODULE_HOOK_ATTRS:
            d = getattr(mod, attr, None)
            if d is not None:
                snap[(name, attr)] = list(d.keys())
    from torch.nn.modules import module as nn_module

    for attr in GLOBAL_HOOK_ATTRS:
        snap[("<global>", attr)] = list(getattr(nn_module, attr, {}).keys())
    return snap


def assert_hooks_unchanged(model: nn.Module, before: dict, when: str) -> None:
    """The model's module hooks are the ones it had before."""
    after = hook_snapshot(model)
    if after != before:
        diff = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
        raise AssertionError(f"{when}: module hooks changed (key: (before, after)): {diff}")


def assert_no_tapesac_hooks(model: nn.Module, when: str) -> None:
    """No hook of tapesac's (of any module in tapesac's package) is left on any submodule."""
    left = [(name, attr, type(h).__module__) for name, mod in model.named_modules() for attr in MODULE_HOOK_ATTRS
            for h in (getattr(mod, attr, None) or {}).values()
            if (getattr(h, "__module__", None) or type(h).__module__ or "").startswith("tapesac")]
    # The conflict watch's post-accumulate-grad hooks on parameters (conflicts.py) go too.
    left += [(name, "_post_accumulate_grad_hooks", type(h).__module__) for name, p in model.named_parameters()
             for h in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()
             if type(h).__module__.startswith("tapesac")]
    assert not left, f"{when}: tapesac's hooks are still on the model after close(): {left}"


def assert_no_saved_tensor_hooks(when: str = "") -> None:
    """No saved-tensor hooks are installed, autograd saves real tensors again, and no recorder or write watcher is
    attached to the dispatch hook on this thread."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    assert top is None, f"{when}: a saved-tensor hook pair is still installed outside the step: {top}"
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    saved = y.grad_fn._saved_result
    assert isinstance(saved, torch.Tensor) and torch.equal(saved, y.detach()), (
        f"{when}: autograd's saved result is {type(saved).__name__}, not the tensor itself")
    assert torch.is_grad_enabled(), f"{when}: grad mode was left disabled"
    # The dispatch hook's key (Note [Dispatch hook]; torch's Python enum does not name it, its key set's repr does).
    assert "TESTING_ONLY_GenericMode" not in str(torch._C._dispatch_tls_local_include_set()), (
        f"{when}: the dispatch hook's key is still in this thread's dispatch key set (a recorder or write watcher "
        f"left attached)")


def assert_no_thread_step(when: str = "") -> None:
    """No step is open on this thread: a fresh TapeSAC on a fresh model runs an exact step."""
    assert_exact_step(None, small_stack(), when=f"{when}: a fresh TapeSAC after")


def small_stack(n: int = 2, dropout: bool = True, d: int = D_SMALL) -> M.Stack:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blocks = [M.MLPBlock(d, 2 * d) for _ in range(n)]
        if dropout:
            blocks.append(M.DropoutBlock(d, p=0.3))
        return M.Stack(blocks)


def small_input(d: int = D_SMALL, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 6, d, generator=g).requires_grad_()


def assert_exact_step(sac: Any, model: nn.Module, *, ref: nn.Module | None = None, policy: Any = "full",
                      blocks: Any = "blocks.*", when: str = "", seed: int = 77, expect_drop: bool | None = None,
                      loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> Any:
    """One step of `sac` (a new TapeSAC on `model` if None) against a plain run of `ref` (a deep copy of `model`
    taken now if None): loss, parameter and input gradients bitwise equal, and the RNG state after the step.
    Gradients of both models are reset first. Returns the step's StepStats."""
    import tapesac

    ref = copy.deepcopy(model) if ref is None else ref
    own = sac is None
    if own:
        sac = tapesac.TapeSAC(model, blocks=blocks, policy=policy)
    loss_fn = loss_fn or (lambda m, x: m(x).square().mean())
    try:
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        d = next(iter(model.parameters())).shape[-1]
        xr, x = small_input(d, seed), small_input(d, seed)
        torch.manual_seed(seed)
        ref_loss = loss_fn(ref, xr)
        ref_loss.backward()
        want_rng = torch.get_rng_state()
        torch.manual_seed(seed)
        with sac.step():
            loss = loss_fn(model, x)
            loss.backward()
        assert_same_tensor(f"{when}: loss", loss.detach(), ref_loss.detach())
        assert assert_same_grads(model, ref, f"{when}: ") > 0
        assert_same_tensor(f"{when}: input grad", x.grad, xr.grad)
        assert torch.equal(torch.get_rng_state(), want_rng), f"{when}: the CPU RNG state differs after the step"
        st = sac.last_step
        assert st is not None and st.ops_recorded > 0, f"{when}: the step recorded nothing: {st}"
        if expect_drop is None:
            expect_drop = policy == "full"
        if expect_drop:
            assert st.dropped_tensors > 0 and st.ops_replayed > 0, f"{when}: nothing dropped/replayed: {st}"
        return st
    finally:
        if own:
            sac.close()


# ----------------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------------


class StorageTracker:
    """Weak references to the storages of the tensors a block creates (input excluded): `alive()` lists the ones
    not yet released. Install with `track(module)`; the forward hook runs outside any step's own hooks."""

    def __init__(self) -> None:
        self.refs: list[tuple[str, StorageWeakRef]] = []
        self._handles = []

    def track(self, module: nn.Module, name: str) -> None:
        def hook(_m, _args, out):
            if isinstance(out, torch.Tensor):
                self.refs.append((name, StorageWeakRef(out.untyped_storage())))
        self._handles.append(module.register_forward_hook(hook))

    def track_all_leaves(self, model: nn.Module) -> None:
        for name, mod in model.named_modules():
            if not list(mod.children()):
                self.track(mod, name)

    def alive(self) -> list[str]:
        return [n for n, r in self.refs if not r.expired()]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def live_tensor_count() -> int:
    """The number of torch.Tensor objects the garbage collector tracks (after a full collection)."""
    gc.collect()
    n = 0
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor):
                n += 1
        except ReferenceError:
            pass
    return n

