"""Python higher-order operators inside recorded blocks (Note [Higher-order operators pass the hook's key],
python/tapesac/higher_order.py).

Before 2026-12-07 `torch.cond` and `torch.func.vmap` over an `autograd.Function` with `generate_vmap_rule` raised
torch's untyped "could not find kernel ... at dispatch key DispatchKey.???" inside a block under the dispatch hook (a
helper's finding), where plain PyTorch ran them. Reference: a deep copy run without tapesac, loss, every gradient and
the RNG state bitwise equal (conftest.reference_check).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import reference_check

pytestmark = pytest.mark.usefixtures("one_thread")

D = 8


class _Sigmoid(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.sigmoid(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y * (1 - y)


def _cond(h):
    return torch.cond(h.sum() > 0, lambda t: t.sin() * t, lambda t: t.cos() * t, (h,))


def _vmap_function(h):
    return torch.func.vmap(_Sigmoid.apply)(h)


class _Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h = _cond(h) if self.kind == "cond" else _vmap_function(h)
        return self.out(h * h) + x


class _Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(kind) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("kind", ["cond", "vmap_function"])
@pytest.mark.parametrize("policy,kwargs", [("none", {}), ("full", {}), ("full", {"schedule": "one_segment"}),
                                           ("full", {"backend": "emulated_graph"})])
def test_a_higher_order_operator_inside_a_block_runs_and_is_exact(kind: str, policy: str, kwargs: dict) -> None:
    reference_check(lambda: _Net(kind), lambda: (torch.randn(3, 4, D),), policy, lambda m: list(m.blocks), steps=2,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), sac_kwargs=kwargs,
                    expect_drop=(kind == "cond") if policy == "full" else None)
    # vmap's calls reach the recorder with batched tensors: that block call is not recorded (it keeps its tensors and
    # says why, as any vmap inside a block), exact either way.


def test_the_hook_key_falls_through_higher_order_operators_defined_later() -> None:
    """torch's default fallthrough list carries the key, so an operator defined after tapesac's import has it too."""
    import torch._ops as ops

    import tapesac

    key = torch._C.DispatchKey(tapesac._C.dispatch_hook_key())
    assert key in ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS
    for op in ops._higher_order_ops.values():
        assert not op.non_fallthrough_keys.has(key), op
