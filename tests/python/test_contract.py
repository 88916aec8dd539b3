"""Replay contract checks: version counters (contract="check") and byte checksums (contract="strict")."""

import copy

import pytest
import torch
from torch import nn

import tapesac


def _blocks(n: int = 2) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(n))


def _forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for b in blocks:
        x = x + b(x)
    return x.square().sum()


def _assert_step_exact(sac: tapesac.TapeSAC, blocks: nn.ModuleList, x: torch.Tensor) -> None:
    """One step under `sac` equals a no-checkpoint step of a deep copy, bitwise, and really replayed."""
    blocks.zero_grad(set_to_none=True)
    ref = copy.deepcopy(blocks)
    ref_loss = _forward(ref, x)
    ref_loss.backward()
    with sac.step():
        loss = _forward(blocks, x)
        loss.backward()
    assert torch.equal(loss, ref_loss)
    for a, b in zip(blocks.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert sac.last_step.dropped_tensors > 0 and sac.last_step.ops_replayed > 0


def test_inplace_change_of_a_parameter_before_backward_is_rejected_without_preservation() -> None:
    blocks = _blocks()
    sac = tapesac.TapeSAC(blocks, blocks=blocks, policy="full", contract="check", preserve="off")
    x = torch.randn(4, 16)
    with pytest.raises(tapesac.ReplayContractError, match="modified in place"):
        with sac.step():
            loss = _forward(blocks, x)
            with torch.no_grad():
                blocks[0][0].weight.add_(1.0)  # the replay of block 0 reads this weight
            loss.backward()
    # Nothing is left behind: the next step is exact.
    _assert_step_exact(sac, blocks, x)


def test_inplace_change_of_a_parameter_before_backward_is_recovered_by_default() -> None:
    """The same write with the default preservation: the watcher saved the weight's old bytes before the write, and
    the replay sees the forward's weight — the gradients equal those of the forward as computed."""
    x = torch.randn(4, 16)
    blocks = _blocks()
    ref = copy.deepcopy(blocks)
    _forward(ref, x).backward()
    sac = tapesac.TapeSAC(blocks, blocks=blocks, policy="full")
    with sac.step():
        loss = _forward(blocks, x)
        with torch.no_grad():
            blocks[0][0].weight.add_(1.0)
        loss.backward()
    for a, b in zip(blocks.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert sac.last_step.record_counts.get("recovered", 0) > 0
    assert sac.last_step.preserved[0]["writes"] == 1


def test_change_that_bypasses_version_counters() -> None:
    """.data writes do not bump the version counter. The write watcher still sees them (they go through the
    dispatcher), so by default they are recovered; under preserve="off" it counts them without saving, so the replay
    is rejected (Note [Writes counted under preserve="off"]; this case was silent under "check" before, wrong
    gradients with records saying "match", and caught only by "strict"'s checksum)."""
    x = torch.randn(4, 16)
    ref = _blocks()
    _forward(ref, x).backward()
    for contract, preserve, outcome in (("check", "auto", "recovered"), ("strict", "auto", "recovered"),
                                        ("check", "off", "rejected"), ("strict", "off", "rejected")):
        blocks = _blocks()
        sac = tapesac.TapeSAC(blocks, blocks=blocks, policy="full", contract=contract, preserve=preserve)
        with sac.step():
            loss = _forward(blocks, x)
            blocks[0][0].weight.data.add_(1.0)
            if outcome == "rejected":
                with pytest.raises(tapesac.ReplayContractError, match='preserve="off" saved nothing'):
                    loss.backward()
            else:
                loss.backward()
        statuses = {r["status"] for r in sac.last_records}
        if outcome == "rejected":
            assert "rejected" in statuses, statuses
            continue
        assert sac.last_step.ops_replayed > 0
        same = all(a.grad is not None and torch.equal(a.grad, b.grad)
                   for a, b in zip(blocks.parameters(), ref.parameters()))
        assert same and "recovered" in statuses


def test_strict_passes_and_is_exact_on_an_unchanged_model() -> None:
    blocks = _blocks(3)
    sac = tapesac.TapeSAC(blocks, blocks=blocks, policy="full", contract="strict")
    _assert_step_exact(sac, blocks, torch.randn(4, 16))


class _CtcBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # x [B=2, T=3, 8]
        h = self.lin(x)
        lp = h.log_softmax(-1).transpose(0, 1)
        # targets of different lengths: the CPU kernel leaves the saved log_alpha unwritten past each one's length
        loss = torch.nn.functional.ctc_loss(lp, torch.tensor([[1, 2], [3, 3]]), torch.tensor([3, 3]),
                                            torch.tensor([2, 1]), reduction="none")
        return x + torch.tanh(h * loss.reshape(-1, 1, 1))


@pytest.mark.parametrize("contract", ["check", "strict"])
def test_ctc_loss_with_unequal_targets_is_exact_under_strict(contract: str) -> None:
    """OpFlag kUnwrittenBytes (capture/tape.h): strict compared the bytes of ctc_loss's log_alpha, part of which the
    kernel never writes, and raised a false "diverged" (an adversarial test); check was already exact."""
    torch.manual_seed(0)
    model = nn.Sequential(_CtcBlock(), _CtcBlock())
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 8)
    ref(x).square().mean().backward()
    sac = tapesac.TapeSAC(model, blocks=list(model), policy="full", contract=contract)
    try:
        with sac.step():
            model(x).square().mean().backward()
        assert sac.last_step.ops_replayed > 0
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    finally:
        sac.close()
