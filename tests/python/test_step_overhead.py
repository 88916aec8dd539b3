"""What a step costs around its blocks (issue 20), and that the cheaper forms behave as the ones they replace:
StepStats.blocks converted on first read (Note [Block statistics on demand], stats.py) and the block hooks written
into the modules' hook dicts (Note [Block hooks without handles], hooks.py)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

import models as M


def _stepped(tapesac, n_blocks: int = 3, steps: int = 1, policy: str = "full"):
    model = M.stack(n_blocks)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    x = M.x_in()
    for _ in range(steps):
        with sac.step():
            model(x).sum().backward()
    return model, sac


def _eager_blocks(sac):
    from tapesac.stats import block_stats_from

    return tuple(block_stats_from(r) for r in sac._session.last_stats_rows())


def test_blocks_are_converted_on_first_read_and_equal_the_eager_conversion(tapesac) -> None:
    from tapesac.stats import _PendingBlocks

    model, sac = _stepped(tapesac)
    try:
        st = sac.last_step
        assert type(vars(st)["blocks"]) is _PendingBlocks  # nothing converted by the step itself
        expected = _eager_blocks(sac)
        blocks = st.blocks
        assert type(blocks) is tuple and blocks == expected and len(blocks) == st.block_calls == 3
        assert vars(st)["blocks"] is blocks and st.blocks is blocks  # converted once, then held
        assert all(isinstance(b, tapesac.BlockStats) for b in blocks)
        with pytest.raises(dataclasses.FrozenInstanceError):
            st.blocks = ()
    finally:
        sac.close()


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy", "asdict", "eq", "repr", "replace"])
def test_every_reader_sees_the_converted_blocks(tapesac, how: str) -> None:
    """Each reader of a StepStats whose blocks were never read sees the same BlockStats as one read first."""
    model, sac = _stepped(tapesac)
    try:
        lazy = sac.last_step
        assert type(vars(lazy)["blocks"]).__name__ == "_PendingBlocks"
        expected = _eager_blocks(sac)
        if how == "pickle":
            back = pickle.loads(pickle.dumps(lazy))
            assert type(vars(back)["blocks"]) is tuple and back.blocks == expected and back == lazy
        elif how == "deepcopy":
            assert copy.deepcopy(lazy).blocks == expected
        elif how == "copy":
            assert copy.copy(lazy).blocks == expected
        elif how == "asdict":
            d = dataclasses.asdict(lazy)
            assert [b["name"] for b in d["blocks"]] == [b.name for b in expected]
            assert d["blocks"][0] == dataclasses.asdict(expected[0])
        elif how == "eq":
            other = dataclasses.replace(lazy, blocks=expected)
            assert type(vars(other)["blocks"]) is tuple and other == lazy and lazy == other
            assert dataclasses.replace(lazy, blocks=expected[:1]) != lazy
        elif how == "repr":
            assert repr(expected[0]) in repr(lazy)
        else:
            assert dataclasses.replace(lazy, step=99).blocks == expected
    finally:
        sac.close()


def test_history_drops_old_blocks_without_converting_them(tapesac) -> None:
    from tapesac.core import HISTORY_BLOCK_STEPS

    steps = HISTORY_BLOCK_STEPS + 3
    model, sac = _stepped(tapesac, n_blocks=2, steps=steps)
    try:
        hist = sac.history
        assert len(hist) == steps
        old, recent = hist[: steps - HISTORY_BLOCK_STEPS], hist[steps - HISTORY_BLOCK_STEPS:]
        assert all(vars(s)["blocks"] == () and s.blocks == () and s.block_calls == 2 for s in old)
        assert all(type(vars(s)["blocks"]).__name__ == "_PendingBlocks" for s in recent)
        assert all(len(s.blocks) == 2 for s in recent)
        assert [s.step for s in hist] == list(range(1, steps + 1))
    finally:
        sac.close()


def test_a_capture_error_is_warned_from_the_rows(tapesac, caplog) -> None:
    """The warning of a block whose capture failed is read off the rows (StepStats.blocks stays unconverted)."""

    class Replaces(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(M.D, M.D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.lin(x))
            h.data = torch.zeros_like(h)  # a storage replaced inside the block: its capture fails
            return torch.tanh(h * x)

    model = nn.Sequential(Replaces(), Replaces())
    sac = tapesac.TapeSAC(model, blocks="*", policy="full")
    try:
        with caplog.at_level(logging.WARNING, logger="tapesac"):
            with sac.step():
                model(M.x_in()).sum().backward()
        warned = [r.getMessage() for r in caplog.records if "storage was replaced" in r.getMessage()]
        assert len(warned) == 2 and "block 0:" in warned[0] and "block 1:" in warned[1], warned
        st = sac.last_step
        assert type(vars(st)["blocks"]).__name__ == "_PendingBlocks"
        assert all("storage was replaced" in b.capture_error for b in st.blocks)
    finally:
        sac.close()


def _hook_entries(m: nn.Module) -> tuple[int, ...]:
    return tuple(len(getattr(m, a)) for a in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                                               "_forward_hooks", "_forward_hooks_always_called",
                                               "_forward_hooks_with_kwargs"))


def test_block_hooks_sit_beside_the_users_in_order_and_leave_only_theirs(tapesac) -> None:
    """The step's hooks go last among the hooks present when it starts, a user's hook registered inside the step goes
    after them, removing either removes only itself, and the step's end leaves the user's hooks as they were."""
    model = M.stack(2)
    block = model.blocks[0]
    calls: list[str] = []
    before = block.register_forward_pre_hook(lambda m, a: calls.append("user-before"))
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        empty = _hook_entries(model.blocks[1])
        with sac.step():
            other = model.blocks[1]
            ours = [k for k, h in other._forward_pre_hooks.items() if type(h).__name__ == "_PreHook"]
            post = [k for k, h in other._forward_hooks.items() if type(h).__name__ == "_PostHook"]
            assert len(ours) == len(post) == 1 and ours != post
            assert list(other._forward_pre_hooks_with_kwargs) == ours and list(other._forward_hooks_always_called) == post
            assert not other._forward_hooks_with_kwargs and list(other._forward_pre_hooks)[-1] == ours[0]
            pre = [type(h).__name__ for h in block._forward_pre_hooks.values()]
            assert pre[-2:] == ["function", "_PreHook"]  # the user's first, then the step's (conflict checks prepend)
            after = block.register_forward_pre_hook(lambda m, a: calls.append("user-after"))
            ids = list(block._forward_pre_hooks)
            assert len(set(ids)) == len(ids) and ids[-1] == after.id  # torch's ids: ours never collide with a user's
            before.remove()
            assert [type(h).__name__ for h in block._forward_pre_hooks.values()][-2:] == ["_PreHook", "function"]
            model(M.x_in()).sum().backward()
        assert calls == ["user-after"]
        assert sac.last_step.block_calls == 2 and sac.last_step.dropped_tensors > 0
        assert list(block._forward_pre_hooks) == [after.id] and not block._forward_hooks
        assert _hook_entries(model.blocks[1]) == empty == (0, 0, 0, 0, 0)
        after.remove()
        assert not block._forward_pre_hooks
    finally:
        sac.close()


def test_modules_whose_hook_dicts_are_not_dicts_get_the_public_calls(tapesac) -> None:
    """A module whose hook containers are not plain dicts (another torch, a user's own mapping) is hooked through
    register_forward_pre_hook / register_forward_hook, exactly as exact, and unhooked after the step."""

    class Recording(OrderedDict):
        writes = 0

        def __setitem__(self, k, v) -> None:
            type(self).writes += 1
            super().__setitem__(k, v)

    model = M.stack(2)
    ref = copy.deepcopy(model)
    model.blocks[0]._forward_hooks = Recording()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    x = M.x_in()
    try:
        with sac.step():
            loss = model(x).sum()
            loss.backward()
        assert Recording.writes == 1  # through register_forward_hook
        assert sac.last_step.block_calls == 2 and sac.last_step.dropped_tensors > 0
        ref_loss = ref(x).sum()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert all(_hook_entries(b) == (0, 0, 0, 0, 0) for b in model.blocks)
        assert type(model.blocks[0]._forward_hooks) is Recording
    finally:
        sac.close()


def test_a_model_copied_or_pickled_inside_a_step_holds_inert_hooks(tapesac) -> None:
    from tapesac.inert import Inert

    model = M.stack(2)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        with sac.step():
            twin = copy.deepcopy(model)
            pickled = pickle.loads(pickle.dumps(model))
            model(M.x_in()).sum().backward()
        for m in (twin, pickled):
            hooks = [*m.blocks[0]._forward_pre_hooks.values(), *m.blocks[0]._forward_hooks.values()]
            assert sum(type(h) is Inert for h in hooks) == 2, hooks  # the step's pre-hook and hook
            assert not any(type(h).__name__ in ("_PreHook", "_PostHook") for h in hooks), hooks
            m(M.x_in()).sum().backward()  # inert: no block call opened in sac's session, no error
        assert sac.last_step.block_calls == 2
    finally:
        sac.close()


def test_module_attr_answers_as_getattr_without_raising_inside() -> None:
    """conflicts._module_attr (HF's gradient_checkpointing flag, read every step on every block) answers what
    getattr(module, name, None) answers: an instance attribute, a class attribute, a property's value, None."""
    from tapesac.conflicts import _module_attr

    class WithClassFlag(nn.Module):
        gradient_checkpointing = False

    class WithProperty(nn.Module):
        @property
        def gradient_checkpointing(self) -> bool:
            return True

    plain, cls_flag, prop = nn.Linear(2, 2), WithClassFlag(), WithProperty()
    on = WithClassFlag()
    on.gradient_checkpointing = True
    sub = nn.Module()
    sub.gradient_checkpointing = nn.Linear(1, 1)  # a submodule of that name: nn.Module.__getattr__ finds it
    for m in (plain, cls_flag, prop, on, sub):
        assert _module_attr(m, "gradient_checkpointing") is getattr(m, "gradient_checkpointing", None), m
    assert [_module_attr(m, "gradient_checkpointing") is True for m in (plain, cls_flag, prop, on)] == [
        False, False, True, True]


# Note [Hooks removed whatever interrupts] (hooks.py): a KeyboardInterrupt lands between any two bytecodes. The
# adversarial tests fired real signals every 30 us; here each window is hit deterministically by making the code at
# its edge raise once.
_OURS = ("_PreHook", "_PostHook")


def _ours_left(model: nn.Module) -> list[str]:
    return [type(h).__name__ for m in model.modules()
            for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()) if type(h).__name__ in _OURS]


def _exact_step_after(tapesac, model: nn.Module, sac) -> None:
    """The TapeSAC steps again, exact, with nothing of the interrupted step left on the thread."""
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    ref = copy.deepcopy(model)
    x = M.x_in()
    with sac.step():
        loss = model(x).sum()
        loss.backward()
    assert sac.last_step.block_calls == len(model.blocks) and sac.last_step.dropped_tensors > 0
    ref_loss = ref(x.detach().requires_grad_()).sum()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert not _ours_left(model)


def _interrupt_once(monkeypatch, owner, name: str, after: bool = False) -> None:
    """owner.name raises KeyboardInterrupt at its first call (after running, with `after`)."""
    real = getattr(owner, name)
    fired = []

    def once(*args, **kwargs):
        if fired:
            return real(*args, **kwargs)
        fired.append(1)
        if after:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, once)


@pytest.mark.parametrize("where", ["install_write", "install_fallback", "pre_hook_push", "teardown_remove"])
def test_an_interrupt_leaves_no_hook_and_the_next_step_is_exact(tapesac, monkeypatch, where: str) -> None:
    from tapesac import hooks

    class InterruptOnce(OrderedDict):
        fired = False

        def __setitem__(self, k, v) -> None:
            if not InterruptOnce.fired and type(v).__name__ == "_PostHook":
                InterruptOnce.fired = True
                raise KeyboardInterrupt
            super().__setitem__(k, v)

    model = M.stack(3)
    for m in model.modules():
        m.zero_grad(set_to_none=True)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        with monkeypatch.context() as mp:
            if where == "install_write":  # the second block's handle kept, its entries being written
                calls = []
                real = hooks._DictHooks.__init__

                class Interrupting(OrderedDict):
                    armed = False

                    def __setitem__(self, k, v) -> None:
                        super().__setitem__(k, v)
                        if self.armed:
                            raise KeyboardInterrupt

                def init(self, module, dicts, pre_id, post_id):
                    real(self, module, dicts, pre_id, post_id)
                    calls.append(1)
                    if len(calls) == 2:  # its pre-hook entry is the next write: it lands, then the interrupt
                        interrupting = Interrupting(dicts[0])
                        interrupting.armed = True
                        module.__dict__["_forward_pre_hooks"] = dicts[0] = interrupting
                        written.append(interrupting)

                written: list = []

                mp.setattr(hooks._DictHooks, "__init__", init)
            elif where == "install_fallback":  # the public calls: the post-hook's registration interrupted
                model.blocks[1]._forward_hooks = InterruptOnce()
            elif where == "pre_hook_push":  # the saved-tensor hooks pushed, then the interrupt
                _interrupt_once(mp, hooks, "_push_hooks", after=True)
            else:  # the step's end: the first handle's removal interrupted
                _interrupt_once(mp, hooks._DictHooks, "remove")
            with pytest.raises(KeyboardInterrupt):
                with sac.step():
                    model(M.x_in()).sum().backward()
        if where == "install_write":
            assert written and not any(type(h).__name__ == "_PreHook" for h in written[0].values())
            written[0].armed = False  # the user's dict stays; the next step writes into it
        assert not _ours_left(model)
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
        model.zero_grad(set_to_none=True)
        _exact_step_after(tapesac, model, sac)
    finally:
        sac.close()
    assert not _ours_left(model)


def test_hooks_go_from_a_hook_dict_the_user_replaced_inside_the_step(tapesac) -> None:
    model = M.stack(2)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        with sac.step():
            b = model.blocks[0]
            b._forward_pre_hooks = OrderedDict(b._forward_pre_hooks)
            b._forward_hooks = OrderedDict(b._forward_hooks)
            b._forward_hooks_always_called = OrderedDict(b._forward_hooks_always_called)
            model(M.x_in()).sum().backward()
        assert sac.last_step.block_calls == 2
        assert not _ours_left(model)
        assert not b._forward_hooks_always_called and not b._forward_pre_hooks_with_kwargs
        assert not b._forward_pre_hooks and not b._forward_hooks  # the conflict checks' step hook went too
    finally:
        sac.close()


def test_a_torchscript_block_is_refused_with_a_typed_error(tapesac) -> None:
    """torch supports no forward hooks on TorchScript modules (every step raised torch's untyped RuntimeError)."""
    model = M.stack(2)
    model.blocks[0] = torch.jit.script(model.blocks[0])
    with pytest.raises(tapesac.ConfigError, match="TorchScript module"):
        tapesac.TapeSAC(model, blocks="blocks.*", policy="full")


def test_module_attr_follows_getattr_for_wrappers_and_descriptors() -> None:
    from tapesac.conflicts import _module_attr

    inner = nn.Linear(2, 2)
    inner.gradient_checkpointing = True

    class Forwards(nn.Module):  # a wrapper forwarding unknown names, as peft's and torch.compile's do
        def __init__(self, wrapped: nn.Module) -> None:
            super().__init__()
            self.wrapped = wrapped

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.wrapped, name)

    class Prop(nn.Module):
        @property
        def gradient_checkpointing(self) -> bool:
            return False

    shadowed = Prop()
    shadowed.__dict__["gradient_checkpointing"] = True  # the property wins for getattr
    for m in (Forwards(inner), torch.compile(inner), shadowed):
        assert _module_attr(m, "gradient_checkpointing") is getattr(m, "gradient_checkpointing", None), m


def _interrupt_inside(block: nn.Module):
    """A pre-hook on the block's first submodule that raises KeyboardInterrupt once: the block's forward is unwound by
    a BaseException, for which torch runs no always-called forward hook."""
    fired = []

    def interrupt(mod, args):
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt

    return next(iter(block.children())).register_forward_pre_hook(interrupt)


def test_after_an_interrupted_forward_the_attached_steps_checkpoint_again(tapesac) -> None:
    """Note [A block call a BaseException left open] (hooks.py): with sac.attach a Ctrl-C in a block's forward left its
    block call open; the next iteration's blocks ran as calls of it (nothing dropped) until optimizer.step()."""
    model = M.stack(2)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    att = sac.attach(opt)
    try:
        handle = _interrupt_inside(model.blocks[0])
        with pytest.raises(KeyboardInterrupt):
            model(M.x_in()).sum().backward()
        handle.remove()
        torch.manual_seed(5)
        xs = [M.x_in() for _ in range(3)]
        for x in xs:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        for x in xs:
            opt_ref.zero_grad()
            ref(x.detach().requires_grad_()).sum().backward()
            opt_ref.step()
        steps = sac.history
        assert all(s.block_calls >= 2 and s.dropped_tensors > 0 for s in steps), [
            (s.block_calls, s.dropped_tensors) for s in steps]
        assert steps[0].blocks[0].capture_error == "" or steps[0].kept_tensors > 0
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    finally:
        att.detach()
        sac.close()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert not _ours_left(model)


def test_a_forward_interrupted_and_run_again_inside_one_step_is_exact(tapesac) -> None:
    model = M.stack(2)
    ref = copy.deepcopy(model)
    x = M.x_in()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        with sac.step():
            handle = _interrupt_inside(model.blocks[1])
            with pytest.raises(KeyboardInterrupt):
                model(x)
            handle.remove()
            loss = model(x).sum()
            loss.backward()
        st = sac.last_step
        # the interrupted call of block 1 is closed as a forward that raised (it keeps what it saved); the second
        # forward's two calls are recorded and drop
        assert st.block_calls == 4 and st.dropped_tensors > 0, (st.block_calls, st.dropped_tensors)
        assert [b.name for b in st.blocks] == ["blocks.0", "blocks.1", "blocks.0", "blocks.1"]
        assert st.blocks[2].dropped_tensors > 0 and st.blocks[3].dropped_tensors > 0
        ref_loss = ref(x.detach().requires_grad_()).sum()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    finally:
        sac.close()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
