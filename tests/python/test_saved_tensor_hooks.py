"""The saved-tensor hooks a step hands to autograd are plain C functions bound to the session (Note [Hooks without
pybind11], bind_replay.cpp): their errors are typed like every binding's, they keep the session alive, and a step
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
