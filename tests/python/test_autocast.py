"""Autocast: the tape records the ops autocast produced (casts included) and replay runs exactly those."""

import copy

import pytest
import torch
from torch import nn

import tapesac


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Softmax(-1)) for _ in range(2)
    )


def _forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for b in blocks:
        x = x + b(x)
    return x.float().square().sum()


@pytest.mark.parametrize("backward_in_autocast", [True, False])
def test_bf16_autocast_is_exact(backward_in_autocast: bool) -> None:
    blocks = _blocks()
    ref = copy.deepcopy(blocks)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = _forward(ref, x)
    ref_loss.backward()
    sac = tapesac.TapeSAC(blocks, blocks=blocks, policy="full")
    with sac.step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _forward(blocks, x)
            if backward_in_autocast:
                loss.backward()
        if not backward_in_autocast:
            loss.backward()
    assert torch.equal(loss, ref_loss)
    for a, b in zip(blocks.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    replayed = sac.last_step.ops_replayed_by_name
    assert replayed.get("aten::_to_copy", 0) > 0 and replayed.get("aten::addmm", 0) > 0


def test_autocast_ops_are_recorded_after_casting() -> None:
    blocks = _blocks()
    x = torch.randn(4, 16)
    plain = tapesac.record_ops(blocks[0], x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = tapesac.record_ops(blocks[0], x)
    assert "aten::_to_copy" not in plain
    # Each addmm is preceded by the casts of its operands, and addmm itself is recorded once (the inner call).
    assert cast.count("aten::addmm") == plain.count("aten::addmm") == 2
    assert cast.count("aten::_to_copy") >= 3
