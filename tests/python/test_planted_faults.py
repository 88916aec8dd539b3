"""Planted faults between a block's forward and its replay (issue: replay contracts). Each one is either detected
(ReplayContractError, with a "rejected" or "divergent" execution record) or recovered exactly: the loss and every
gradient bitwise equal to what the forward computed. None may pass silently with a different gradient.

The README's fault table is these cases; `test_fault_table_counts` checks its totals.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tapesac

D = 16


class Block(nn.Module):
    """y = x + fc2(gelu(fc1(2 * x))): the block input is read only by replay (mul by a Python number saves nothing),
    fc1's weight is read only by replay when x does not require grad, fc2's weight is saved by autograd."""

    def __init__(self, p_drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.p = p_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x * 2.0))
        if self.p:
            h = F.dropout(h, self.p, training=True)
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, p_drop: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(p_drop) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return x


@dataclass
class Fault:
    name: str
    plant: Callable[[Net, torch.Tensor, torch.Tensor], None]  # (model, block input, loss) -> in-place change
    expected: str  # "recovered", "match" (nothing to recover) or "rejected"/"divergent"
    p_drop: float = 0.0
    contract: str = "check"


def _mutate_block_input(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    with torch.no_grad():
        x.mul_(3.0)


def _mutate_param_read_by_replay(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    with torch.no_grad():
        m.layers[0].fc1.weight.add_(1.0)


def _mutate_param_autograd_saved(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    with torch.no_grad():
        m.layers[1].fc2.weight.add_(1.0)


def _write_through_alias(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    with torch.no_grad():
        x.view(-1)[:5].fill_(7.0)  # a view shares the version counter and the storage


def _change_global_rng(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    torch.manual_seed(1234)


def _replace_data(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    w = m.layers[0].fc1.weight
    w.data = w.data * 2.0  # new storage; version counters are not bumped


def _set_twice(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    w = m.layers[0].fc1.weight
    with torch.no_grad():  # Tensor.set_: the dispatcher's `.data =` (new storage, version bumped each time)
        w.set_(w.detach().clone() * 2.0)
        w.set_(w.detach().clone() * 2.0)


def _set_then_write(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    w = m.layers[0].fc1.weight
    with torch.no_grad():
        w.set_(w.detach().clone() * 2.0)
        w.mul_(3.0)  # writes the new storage: the forward's bytes are untouched


def _write_through_data(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    m.layers[0].fc1.weight.data.add_(1.0)  # same storage, no version bump: only the write watcher sees it


def _write_through_numpy(m: Net, x: torch.Tensor, loss: torch.Tensor) -> None:
    m.layers[0].fc1.weight.detach().numpy()[:] += 1.0  # outside the dispatcher: no version, no watcher


FAULTS = [
    Fault("block input modified in place (read only by replay)", _mutate_block_input, "recovered"),
    Fault("parameter modified in place (read only by replay)", _mutate_param_read_by_replay, "recovered"),
    Fault("parameter modified in place (saved by autograd)", _mutate_param_autograd_saved, "rejected"),
    Fault("write through an alias (view) of a block input", _write_through_alias, "recovered"),
    Fault("global RNG state changed (dropout in the block)", _change_global_rng, "match", p_drop=0.3),
    Fault("tensor's .data replaced", _replace_data, "recovered"),
    # Found by an adversarial test: rejected, the message blaming another thread ("its version moved by 2 but the
    # step's thread made only 1 in-place writes"): the version counter follows the tensor to its new storage.
    Fault("tensor's storage replaced twice with set_", _set_twice, "recovered"),
    Fault("storage replaced with set_, then the new one written", _set_then_write, "recovered"),
    Fault("write through .data (no version bump)", _write_through_data, "recovered"),
    Fault("write through numpy, contract=strict", _write_through_numpy, "divergent", contract="strict"),
]


def _reference(m: Net, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of the forward as computed (no fault, no checkpointing, same RNG)."""
    ref = copy.deepcopy(m)
    torch.manual_seed(seed)
    loss = ref(x.clone()).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in ref.parameters()]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_planted_fault_is_detected_or_recovered_exactly(fault: Fault) -> None:
    m = Net(fault.p_drop)
    x = torch.randn(4, D)
    ref_loss, ref_grads = _reference(m, x, seed=7)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", contract=fault.contract)
    xin = x.clone()
    torch.manual_seed(7)
    if fault.expected in ("rejected", "divergent"):
        with pytest.raises(tapesac.ReplayContractError):
            with sac.step():
                loss = m(xin).square().mean()
                fault.plant(m, xin, loss)
                loss.backward()
        statuses = {r["status"] for r in sac.last_records}
        assert fault.expected in statuses, sac.last_records
        return
    with sac.step():
        loss = m(xin).square().mean()
        fault.plant(m, xin, loss)
        rng_after_plant = torch.get_rng_state()
        loss.backward()
    assert sac.last_step.ops_replayed > 0
    # Replay leaves the global generator where the user put it.
    assert torch.equal(torch.get_rng_state(), rng_after_plant)
    assert torch.equal(loss.detach(), ref_loss)
    for g, r in zip((p.grad for p in m.parameters()), ref_grads):
        assert torch.equal(g, r)
    statuses = {r["status"] for r in sac.last_records}
    if fault.expected == "recovered":
        assert "recovered" in statuses, sac.last_records
    else:
        assert statuses == {"match"}, sac.last_records


def test_off_rejects_what_preservation_recovers() -> None:
    m = Net()
    x = torch.randn(4, D)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", preserve="off")
    with pytest.raises(tapesac.ReplayContractError, match="modified in place after the block's forward"):
        with sac.step():
            loss = m(x).square().mean()
            _mutate_param_read_by_replay(m, x, loss)
            loss.backward()
    statuses = [r["status"] for r in sac.last_records]
    assert statuses[-1] == "rejected" and set(statuses[:-1]) <= {"match"}, statuses


def test_write_on_another_thread_is_rejected() -> None:
    """The watcher sees the step's thread only: a write elsewhere moves the version counter past the writes it
    saved, and the replay is rejected rather than served wrong bytes."""
    import threading

    m = Net()
    x = torch.randn(4, D)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full")
    with pytest.raises(tapesac.ReplayContractError, match="another thread"):
        with sac.step():
            loss = m(x).square().mean()
            t = threading.Thread(target=_mutate_param_read_by_replay, args=(m, x, loss))
            t.start()
            t.join()
            loss.backward()


def test_numpy_write_is_silent_under_check_and_caught_by_strict() -> None:
    """The documented limit of contract="check": a write that bypasses the dispatcher changes no version and no
    watcher sees it; only the strict contract's byte checksums catch it (test above)."""
    m = Net()
    x = torch.randn(4, D)
    ref_loss, ref_grads = _reference(m, x, seed=7)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", contract="check")
    with sac.step():
        loss = m(x).square().mean()
        _write_through_numpy(m, x, loss)
        loss.backward()
    assert not all(torch.equal(p.grad, r) for p, r in zip(m.parameters(), ref_grads))


class NumpyTanh(torch.autograd.Function):
    """A custom Function the recorder cannot see into: its forward runs in numpy."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        y = torch.from_numpy(np.tanh(x.detach().numpy()))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class OpaqueBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(NumpyTanh.apply(self.fc1(x)).square())


def test_custom_function_the_recorder_cannot_see_is_kept_and_exact() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(OpaqueBlock() for _ in range(2))
    x = torch.randn(4, D, requires_grad=True)
    ref = copy.deepcopy(layers)
    xr = x.detach().clone().requires_grad_()
    out = xr
    for b in ref:
        out = b(out)
    out.sum().backward()
    sac = tapesac.TapeSAC(layers, blocks=layers, policy="full")
    with sac.step():
        out = x
        for b in layers:
            out = b(out)
        out.sum().backward()
    st = sac.last_step
    # numpy's output enters the tape as an external value (never replayed, held); the rest replays.
    assert st.ops_replayed > 0 and st.dropped_tensors > 0
    assert torch.equal(x.grad, xr.grad)
    for p, q in zip(layers.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_fault_table_counts() -> None:
    """The README's table: every planted fault is recovered, matched or detected; none silent."""
    outcomes = [f.expected for f in FAULTS] + ["match"]  # + the custom Function
    assert len(outcomes) == 11
    assert outcomes.count("recovered") == 7
    assert outcomes.count("rejected") + outcomes.count("divergent") == 2
    assert outcomes.count("match") == 2


def test_off_replays_exactly_after_set_then_a_write_to_the_new_storage() -> None:
    """set_ rebinds the weight to a new storage and writes no byte of the forward's (an adversarial test: it was
    recorded and watched as a write to the old storage). The replay reads the forward's storage, which nothing wrote:
    exact under preserve="off" too, where it used to be rejected as a write "off" could not undo."""
    m = Net()
    x = torch.randn(4, D)
    ref_loss, ref_grads = _reference(m, x, seed=7)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", preserve="off")
    torch.manual_seed(7)
    with sac.step():
        loss = m(x.clone()).square().mean()
        _set_then_write(m, x, loss)
        loss.backward()
    assert sac.last_step.ops_replayed > 0 and torch.equal(loss.detach(), ref_loss)
    for g, r in zip((p.grad for p in m.parameters()), ref_grads):
        assert torch.equal(g, r)
    sac.close()


@pytest.mark.parametrize("plant", [_write_through_data], ids=["data_write"])
def test_off_rejects_writes_that_move_no_version(plant) -> None:
    """Found by an adversarial test: under preserve="off" a write that moves no version counter (through `.data`, an
    alias made by set_, untyped_storage().copy_) reached the replay silently — wrong gradients, records saying
    "match" — where the README says "off" rejects. The watcher now counts writes under "off" without saving them
    (Note [Writes counted under preserve="off"]): rejected."""
    m = Net()
    x = torch.randn(4, D)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", preserve="off")
    with pytest.raises(tapesac.ReplayContractError, match='preserve="off" saved nothing'):
        with sac.step():
            loss = m(x).square().mean()
            plant(m, x, loss)
            loss.backward()
    assert sac.last_records[-1]["status"] == "rejected", sac.last_records
