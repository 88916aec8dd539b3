"""The saved-tensor hooks a step hands to autograd are plain C functions bound to the session (Note [Hooks without
pybind11], saved_hooks.cpp): their errors are typed like every binding's, they keep the session alive, and a step
through them is exact."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import tapesac
from tapesac import _C
from tapesac.errors import TapeSACError


def _session() -> object:
    sac = tapesac.TapeSAC(nn.Sequential(nn.Linear(4, 4)), blocks="0", policy="full")
    return sac, sac._session


def test_hooks_are_c_functions_that_reject_bad_input_with_typed_errors() -> None:
    sac, session = _session()
    pack, unpack = session.saved_tensor_hooks()
    assert type(pack).__name__ == "builtin_function_or_method"
    with pytest.raises(TypeError, match="pack expected a tensor, got str"):
        pack("not a tensor")
    with pytest.raises(TapeSACError, match="unpack expected a tensor or a tapesac saved slot, got int"):
        unpack(3)
    # Outside a block call pack saves the tensor itself (an alias sharing its storage) and unpack returns it.
    t = torch.randn(3)
    packed = pack(t)
    assert isinstance(packed, torch.Tensor) and packed.data_ptr() == t.data_ptr()
    assert unpack(packed) is not None and torch.equal(unpack(packed), t)
    sac.close()


def test_hooks_keep_their_session_alive() -> None:
    session = _C.Session("full")
    ref = weakref.ref(session)
    pack, unpack = session.saved_tensor_hooks()
    del session
    gc.collect()
    assert ref() is not None  # the hooks hold it
    assert torch.equal(unpack(pack(torch.ones(2))), torch.ones(2))
    del pack, unpack
    gc.collect()
    assert ref() is None


def test_a_step_through_the_c_hooks_is_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    x = torch.randn(5, 8)
    ref_model(x).square().sum().backward()
    sac = tapesac.TapeSAC(model, blocks="*", policy="full")
    try:
        with sac.step():
            model(x).square().sum().backward()
        assert sac.last_step.block_calls == 3 and sac.last_step.ops_replayed > 0
    finally:
        sac.close()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)


class _Recursive(nn.Module):
    """A block that calls itself once (a recursive module), inside the user's own saved-tensor hooks (fp16 packing,
    as an offload or compression hook would)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 32), nn.Linear(32, d)

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        h = self.a(x)
        if depth == 0:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.half(), lambda t: t.float()):
                inner = self(x * 0.5, depth=1)
                h = torch.tanh(h) * inner.sum(-1, keepdim=True).tanh()
        return self.b(torch.tanh(h)) + x


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_block_that_calls_itself_closes_its_own_call_only(policy: str) -> None:
    """The inner call's post-hook closed the outer block call and popped the top of the saved-tensor hook stack — the
    user's pair, not tapesac's: the ops after the inner call skipped the user's hooks (max gradient difference 3.3e-3
    under every policy, "none" included; an adversarial test)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Recursive(), _Recursive())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    ref(x).square().sum().backward()
    sac = tapesac.TapeSAC(model, blocks="*", policy=policy)
    try:
        with sac.step():
            model(x).square().sum().backward()
        assert sac.last_step.block_calls == 2
    finally:
        sac.close()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), (name, (p.grad - q.grad).abs().max().item())


def test_a_block_leaving_saved_tensor_hooks_pushed_keeps_them_and_leaves_nothing_of_tapesac() -> None:
    """A block whose forward enters saved-tensor hooks and never exits them: closing the block call popped the top of
    the stack — the block's pair — and left tapesac's pair on the stack after the step. tapesac's own pair goes now;
    the block's stays on top, as without tapesac, and the gradients are plain PyTorch's."""

    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            torch.autograd.graph.saved_tensors_hooks(lambda t: t.half(), lambda t: t.float()).__enter__()
            return torch.tanh(h) * h

    def run(m: nn.Module, sac: tapesac.TapeSAC | None) -> None:
        try:
            if sac is None:
                m(torch.ones(2, 8)).sum().backward()
            else:
                with sac.step():
                    m(torch.ones(2, 8)).sum().backward()
        finally:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            assert top is not None and top[0].__name__ == "<lambda>", top  # the block's own pair, never exited
            torch._C._autograd._pop_saved_tensors_default_hooks()
            assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None, "tapesac's pair was left"

    torch.manual_seed(0)
    model = nn.Sequential(Leaky())
    ref = copy.deepcopy(model)
    run(ref, None)
    sac = tapesac.TapeSAC(model, blocks="*", policy="full")
    try:
        run(model, sac)
    finally:
        sac.close()
    assert torch.equal(model[0].lin.weight.grad, ref[0].lin.weight.grad)
