"""Preservation of external tensors written in place between a block's forward and its replay (regions, snapshots,
keep, auto), execution records, tapesac.validate, and side effects happening once (BatchNorm)."""

from __future__ import annotations

import copy
import json
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tapesac
from conftest import assert_same_grads
from tapesac import preserve as P

D = 32
ROWS = 400


class BankBlock(nn.Module):
    """Reads a memory bank through index_select (autograd saves only the indices, so the bank is read by replay)."""

    def __init__(self, bank: torch.Tensor):
        super().__init__()
        self.bank = bank
        self.q = nn.Linear(D, D)
        self.o = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        mem = self.bank.index_select(0, ids)
        a = torch.softmax(self.q(x) @ mem.t(), -1)
        return x + self.o(a @ mem)


class BankNet(nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("bank", torch.randn(ROWS, D))
        self.layers = nn.ModuleList(BankBlock(self.bank) for _ in range(layers))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x, ids)
        return x


def _bank_step(m: BankNet, x: torch.Tensor, ids: torch.Tensor, write: Callable[[torch.Tensor], None]) -> torch.Tensor:
    loss = m(x, ids).square().mean()
    with torch.no_grad():
        write(m.bank)
    loss.backward()
    return loss.detach()


WRITES: dict[str, Callable[[torch.Tensor], None]] = {
    "index_put_": lambda b: b.__setitem__(torch.tensor([0, 2, 7, 399]), torch.full((4, D), 5.0)),
    "bool mask index_put_": lambda b: b.__setitem__(b[:, 0] > 1.0, 0.0),
    "index_copy_": lambda b: b.index_copy_(0, torch.tensor([3, 4]), torch.ones(2, D)),
    "index_fill_": lambda b: b.index_fill_(1, torch.tensor([1, 5]), -2.0),
    "index_add_": lambda b: b.index_add_(0, torch.tensor([6, 6, 8]), torch.ones(3, D)),
    "scatter_": lambda b: b.scatter_(1, torch.zeros(ROWS, 1, dtype=torch.long), 9.0),
    "masked_fill_": lambda b: b.masked_fill_(b > 2.0, 0.0),
    "slice copy_": lambda b: b[10:20].copy_(torch.zeros(10, D)),
    "column slice mul_": lambda b: b[:, 3:5].mul_(0.5),
    "whole add_": lambda b: b.add_(1.0),
    "two overlapping writes": lambda b: (b[0:50].zero_(), b.index_fill_(0, torch.tensor([1, 40, 60]), 3.0)),
    "roll (dense queue)": lambda b: b.copy_(torch.roll(b.clone(), 16, 0)),
    # Python indexing with a full slice before the index: index_put_ with an undefined (None) index, which the region
    # save cloned (an adversarial test: "tensor does not have a device" on every step, preserve="auto" unusable).
    "setitem [:, idx]": lambda b: b.__setitem__((slice(None), torch.tensor([0, 5])), 1.0),
    "setitem [..., idx]": lambda b: b.__setitem__((Ellipsis, torch.tensor([1, -1])), torch.ones(ROWS, 2)),
    "setitem [idx, :, None]": lambda b: b.unsqueeze(-1).__setitem__((torch.tensor([3, 9]), slice(None), 0), 2.0),
    # negative indices, which index_fill_ accepts and index_select (the region save's read) did not
    "index_fill_ negative": lambda b: b.index_fill_(0, torch.tensor([-1, 2]), 7.0),
}


@pytest.mark.parametrize("mode", ["regions", "snapshots"])
@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_write_kinds_are_recovered_exactly(write: str, mode: str) -> None:
    m = BankNet()
    ref = copy.deepcopy(m)
    x, ids = torch.randn(8, D), torch.arange(0, ROWS, 3)
    ref_loss = _bank_step(ref, x, ids, WRITES[write])
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", preserve=mode)
    with sac.step():
        loss = _bank_step(m, x, ids, WRITES[write])
    assert torch.equal(loss, ref_loss)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(m.bank, ref.bank)  # the real buffer holds the write; only replay saw the old bytes
    st = sac.last_step
    assert st.record_counts.get("recovered", 0) > 0 and set(st.record_counts) == {"recovered"}
    (p,) = st.preserved
    assert p["mode"] == mode and p["writes"] >= 1 and p["restores"] == 3  # one private copy per block's replay
    if mode == "snapshots":
        assert p["held_bytes"] == ROWS * D * 4
    elif write in ("index_put_", "index_copy_", "slice copy_"):
        assert p["held_bytes"] < ROWS * D * 4 // 10  # a few rows, not the bank


def test_sparse_writes_over_steps_all_modes_exact_and_auto_chooses() -> None:
    base = BankNet()
    x, ids = torch.randn(8, D), torch.arange(0, ROWS, 2)
    write = WRITES["index_put_"]
    peaks = {}
    for mode in ("regions", "snapshots", "keep", "auto"):
        m, ref = copy.deepcopy(base), copy.deepcopy(base)
        sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", preserve=mode)
        for step in range(4):
            ref_loss = _bank_step(ref, x, ids, write)
            with sac.step():
                loss = _bank_step(m, x, ids, write)
            assert torch.equal(loss, ref_loss)
            for p, q in zip(m.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
            m.zero_grad()
            ref.zero_grad()
        st = sac.last_step
        peaks[mode] = st.memory.peak_bytes
        if mode == "keep":
            # From the second step the activations that read the bank are kept: nothing to recover.
            assert st.preserved == () and st.dropped_tensors == 0 or all(
                r == "match" for r in st.record_counts)
        if mode == "auto":
            # Steps 1-3 tried regions, snapshots and keep; the lowest measured peak stays.
            assert [t.mode for t in sac.preservation_trials] == ["regions", "snapshots", "keep"]
            chosen = min(sac.preservation_trials, key=lambda t: t.peak_bytes).mode
            assert set(sac.preservation.values()) == {chosen}
            with sac.step():
                _bank_step(m, x, ids, write)
            peaks[mode] = sac.last_step.memory.peak_bytes
    assert peaks["auto"] == min(peaks["regions"], peaks["snapshots"], peaks["keep"])


def test_pick_from_measured_trials() -> None:
    trials = [P.Trial("regions", 1000, 5.0), P.Trial("snapshots", 1100, 2.0), P.Trial("keep", 1300, 1.0)]
    assert P.pick(trials, None) == "regions"  # no limit: the lowest measured peak
    assert P.pick(trials, 2000) == "keep"  # all fit: the cheapest
    assert P.pick(trials, 1200) == "snapshots"
    assert P.pick(trials, 500) == "regions"  # none fits: the lowest peak
    with pytest.raises(ValueError):
        P.pick([], None)


def test_records_file_and_validate(tmp_path) -> None:
    m = BankNet(2)
    x, ids = torch.randn(8, D), torch.arange(0, ROWS, 3)
    path = tmp_path / "replays.jsonl"
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", records=path)
    for _ in range(2):
        with sac.step():
            _bank_step(m, x, ids, WRITES["index_put_"])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["step"] for r in lines} == {1, 2}
    assert all(r["status"] == "recovered" and r["bytes"] > 0 and r["time_ns"] > 0 for r in lines)
    assert {"block", "value", "op", "status", "bytes", "time_ns", "detail"} <= set(lines[0])
    sac.close()

    report = tapesac.validate(BankNet(2), lambda mm: _bank_step(mm, x, ids, WRITES["index_put_"]), blocks="layers.*",
                              policy="full")
    assert report.bitwise_equal and report.max_abs == 0.0 and report.error == ""
    assert report.counts().get("recovered", 0) > 0
    assert "bitwise equal" in report.pretty()
    bad = tapesac.validate(BankNet(2), lambda mm: _bank_step(mm, x, ids, WRITES["index_put_"]), blocks="layers.*",
                           policy="full", preserve="off")
    assert not bad.bitwise_equal and "ReplayContractError" in bad.error and bad.counts().get("rejected") == 1


def test_validate_reports_gradient_differences() -> None:
    """validate compares against the copy: a step_fn that behaves differently on the second call shows up."""
    calls = []

    def step(mm: nn.Module) -> torch.Tensor:
        calls.append(1)
        x = torch.ones(2, D) * len(calls)  # differs between the reference and the tapesac run
        loss = mm(x, torch.arange(4)).sum()
        loss.backward()
        return loss

    r = tapesac.validate(BankNet(2), step, blocks="layers.*", policy="full")
    assert not r.bitwise_equal and r.max_abs > 0 and r.max_rel > 0
    assert any(not d.bitwise_equal for d in r.gradients)


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.bn(self.fc(x)))


def test_batchnorm_running_stats_updated_once() -> None:
    """PyTorch's checkpoint updates BatchNorm running statistics twice (once more in the recompute); tapesac never
    re-applies a write to external state: the statistics and gradients equal a no-checkpoint step's."""
    torch.manual_seed(0)
    layers = nn.ModuleList(BNBlock() for _ in range(3)).train()
    ref = copy.deepcopy(layers)
    x = torch.randn(16, D)

    def run(ls: nn.ModuleList) -> None:
        h = x
        for b in ls:
            h = b(h)
        h.square().mean().backward()

    sac = tapesac.TapeSAC(layers, blocks=layers, policy="full")
    for _ in range(2):
        run(ref)
        with sac.step():
            run(layers)
    assert sac.last_step.ops_replayed > 0
    for (n, a), (_, b) in zip(layers.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), n
    for a, b in zip(layers.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert int(layers[0].bn.num_batches_tracked) == 2


def test_no_watcher_state_after_a_rejected_step() -> None:
    m = BankNet(2)
    x, ids = torch.randn(8, D), torch.arange(0, ROWS, 3)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full", preserve="off")
    with pytest.raises(tapesac.ReplayContractError):
        with sac.step():
            _bank_step(m, x, ids, WRITES["index_put_"])
    m.zero_grad()
    ref = copy.deepcopy(m)
    ref_loss = _bank_step(ref, x, ids, lambda b: None)
    with sac.step():
        loss = _bank_step(m, x, ids, lambda b: None)
    assert torch.equal(loss, ref_loss) and sac.last_step.preserved == ()
    assert set(sac.last_step.record_counts) == {"match"}


def test_write_during_the_backward_is_recovered_not_silent() -> None:
    """The watcher watches the backward too (Note [watching the backward], preserve.h): a write made by a hook
    between two blocks' backwards is saved, and the replay that reads the bank sees the forward's bytes — exact like
    the plain run (it used to pause there, and the version check rejected the replay; a `.data` write, which moves
    no version, went through silently: issue 18 item 2)."""
    m = BankNet(2)
    ref = copy.deepcopy(m)
    x, ids = torch.randn(8, D, requires_grad=True), torch.arange(0, ROWS, 3)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full")

    def run(net: BankNet, xx: torch.Tensor) -> None:
        def write_bank(grad: torch.Tensor) -> None:
            with torch.no_grad():
                net.bank[0] += 1.0

        h = net.layers[0](xx, ids)
        h.register_hook(write_bank)  # runs after layers.1's backward (and replay), before layers.0's
        net.layers[1](h, ids).square().mean().backward()

    xr = x.detach().clone().requires_grad_(True)
    run(ref, xr)
    with sac.step():
        run(m, x)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(x.grad, xr.grad) and torch.equal(m.bank, ref.bank)
    assert "recovered" in sac.last_step.record_counts, sac.last_step.record_counts
    assert "rejected" not in sac.last_step.record_counts, sac.last_step.record_counts


def test_gradient_accumulation_within_one_step_sees_writes_again() -> None:
    """Two forward/backward pairs in one step: the watcher resumes with the second forward."""
    m = BankNet(2)
    ref = copy.deepcopy(m)
    x, ids = torch.randn(8, D), torch.arange(0, ROWS, 3)
    write = WRITES["index_put_"]
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full")
    for _ in range(2):
        _bank_step(ref, x, ids, write)
    with sac.step():
        for _ in range(2):
            _bank_step(m, x, ids, write)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert set(sac.last_step.record_counts) == {"recovered"}
    (bank,) = sac.last_step.preserved  # the bank only: no other storage was written
    assert bank["writes"] == 2


def test_bad_preserve_and_records_arguments() -> None:
    m = BankNet(1)
    with pytest.raises(tapesac.ConfigError, match="preserve='sometimes' is not supported"):
        tapesac.TapeSAC(m, blocks=m.layers, preserve="sometimes")
    with pytest.raises(tapesac.ConfigError, match="records must be a file path"):
        tapesac.TapeSAC(m, blocks=m.layers, records=3)


def test_auto_rechooses_under_a_new_limit() -> None:
    """After its three trials, setting a memory_limit makes preserve="auto" choose again: the cheapest mode whose
    measured peak fits; a limit below every trial's peak falls back to the lowest peak."""
    m = BankNet()
    x, ids = torch.randn(8, D), torch.arange(0, ROWS, 2)
    sac = tapesac.TapeSAC(m, blocks=m.layers, policy="full")
    for _ in range(4):
        with sac.step():
            _bank_step(m, x, ids, WRITES["index_put_"])
        m.zero_grad()
    trials = sac.preservation_trials
    assert [t.mode for t in trials] == ["regions", "snapshots", "keep"]
    sac.memory_limit = 10 * max(t.peak_bytes for t in trials)
    assert set(sac.preservation.values()) == {min(trials, key=lambda t: (t.cost_ms, t.peak_bytes)).mode}
    sac.memory_limit = min(t.peak_bytes for t in trials) - 1
    assert set(sac.preservation.values()) == {min(trials, key=lambda t: t.peak_bytes).mode}


class _RefillBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.tanh(self.l1(x)))


def _emptied(t: torch.Tensor) -> torch.Tensor:
    """Frees t's storage and allocates it again, unfilled (untyped_storage().resize_(0), resize_(n)), as FSDP2 does
    between a block's forward and its backward. Returns t's values from before."""
    values, n = t.detach().clone(), t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(n)
    return values


def _step_under_tapesac(model: nn.Module, step: Callable[[nn.Module], None], policy: str = "full",
                        **kwargs) -> None:
    """`step(model)` in one step of a TapeSAC over every block of `model` (closed after); under "full" it replayed."""
    sac = tapesac.TapeSAC(model, blocks="*", policy=policy, **kwargs)
    try:
        with sac.step():
            step(model)
        assert policy != "full" or sac.last_step.ops_replayed > 0
    finally:
        sac.close()


def _refill_step(refill: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[nn.Module], None]:
    """An FSDP2-like step: after the forward, a parameter's bytes are freed (untyped_storage().resize_(0)) and
    allocated again; `refill(w.data, values)` writes them back, and the backward runs."""

    def step(m: nn.Module) -> None:
        loss = m(torch.randn(4, 8)).pow(2).sum()
        w = m[1].l1.weight
        refill(w.data, _emptied(w))
        loss.backward()

    return step


def _chunked_refill(chunks: int, after: Callable[[torch.Tensor], None] | None = None) -> Callable[[nn.Module], None]:
    """The same values copied back in `chunks` row slices (shard by shard); `after` then writes the refilled
    parameter (a real modification)."""

    def refill(w: torch.Tensor, values: torch.Tensor) -> None:
        row = 0
        for c in values.chunk(chunks):
            w[row:row + c.shape[0]].copy_(c)
            row += c.shape[0]
        if after is not None:
            after(w)

    return _refill_step(refill)


REFILLS = {
    "one copy": _chunked_refill(1),
    "two chunks": _chunked_refill(2),
    "four chunks": _chunked_refill(4),
    "two chunks then a write": _chunked_refill(2, lambda w: w.mul_(0.5)),
    "four chunks then a row write": _chunked_refill(4, lambda w: w[2:5].add_(1.0)),
}


@pytest.mark.parametrize("preserve", ["regions", "snapshots", "keep", "off"])
@pytest.mark.parametrize("refill", list(REFILLS), ids=list(REFILLS))
def test_a_parameter_refilled_in_chunks_after_a_free_is_exact(refill: str, preserve: str) -> None:
    """Note [a storage reallocated unseen]: a parameter freed after the forward and refilled before the backward is
    read by plain autograd as refilled. Refilled in row slices, the first slice was not saved (the reallocation seen)
    but the later ones were, as writes of the forward's bytes: their bytes before the write — fresh memory — were
    restored for the replay (max gradient difference 5.2 with two slices, NaN under preserve="regions"). Writes into
    bytes not written since the reallocation now refill; a write of refilled bytes is a write, preserved."""
    torch.manual_seed(0)
    model = nn.Sequential(_RefillBlock(), _RefillBlock())
    ref = copy.deepcopy(model)
    step = REFILLS[refill]
    torch.manual_seed(1)
    step(ref)
    sac = tapesac.TapeSAC(model, blocks="*", policy="full", preserve=preserve)
    torch.manual_seed(1)
    refused = None
    try:
        with sac.step():
            step(model)
        assert sac.last_step.ops_replayed > 0
    except tapesac.ReplayContractError as e:
        refused = e
    finally:
        sac.close()
    if preserve == "off":
        # preserve="off" keeps no bytes and refuses any replay reading a storage written after the forward, a refill
        # included (a refill with other bytes than the forward's would otherwise be read silently): typed.
        assert refused is not None and "preserve" in str(refused), refused
        return
    assert refused is None, refused
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), (name, (p.grad - q.grad).abs().max().item())


def _overlapping(w: torch.Tensor, values: torch.Tensor) -> None:
    w[0:4].copy_(values[0:4])
    w[2:8].copy_(values[2:8])  # rows 2-3 refilled already, rows 4-7 not: neither a refill nor a write


def _strided(w: torch.Tensor, values: torch.Tensor) -> None:
    w[:, 0:4].copy_(values[:, 0:4])  # a column block: not one dense range of bytes
    w[:, 4:8].copy_(values[:, 4:8])


_overlapping_refill, _strided_refill = _refill_step(_overlapping), _refill_step(_strided)


@pytest.mark.parametrize("step", [_overlapping_refill, _strided_refill], ids=["overlapping", "strided"])
def test_a_refill_tapesac_cannot_follow_refuses_the_replay(step: Callable[[nn.Module], None]) -> None:
    """The refills the watcher cannot tell from writes (bytes partly refilled written again; slices that are not one
    dense byte range) make the replays reading the parameter refuse, typed, instead of reading restored fresh memory."""
    torch.manual_seed(0)
    model = nn.Sequential(_RefillBlock(), _RefillBlock())
    sac = tapesac.TapeSAC(model, blocks="*", policy="full", preserve="regions")
    try:
        with pytest.raises(tapesac.ReplayContractError, match="reallocated"):
            with sac.step():
                step(model)
    finally:
        sac.close()


class _Resharding:
    """FSDP2's order without FSDP2: every parameter of a block freed by a forward hook registered before tapesac's
    (untyped_storage().resize_(0)), and reallocated and refilled — in two row slices — when the gradient of the
    block's output arrives, before the block's backward."""

    def __init__(self, model: nn.Sequential) -> None:
        self.freed: dict[nn.Parameter, torch.Tensor] = {}
        for blk in model:
            blk.register_forward_hook(self.after_forward)

    def after_forward(self, blk: nn.Module, args: tuple, out: torch.Tensor) -> None:
        params = list(blk.parameters())
        for p in params:
            self.freed[p] = p.detach().clone()
            p.untyped_storage().resize_(0)
        if out.requires_grad:
            out.register_hook(lambda g: self.refill(params))

    def refill(self, params: list[nn.Parameter]) -> None:
        for p in params:
            values = self.freed.pop(p)
            p.untyped_storage().resize_(values.numel() * values.element_size())
            half = max(1, values.shape[0] // 2)
            p.data[:half].copy_(values[:half])
            p.data[half:].copy_(values[half:])


@pytest.mark.parametrize("preserve", ["regions", "snapshots"])
@pytest.mark.parametrize("schedule", ["one_segment", "planned"])
def test_parameters_resharded_between_forward_and_backward_are_exact(preserve: str, schedule: str) -> None:
    """Note [a storage reallocated unseen], seen freed (replay/src/preserve.cpp): FSDP2's order end to end, over
    several steps with an optimizer in between. glibc rarely hands the freed block back in this history, so this
    passes with the watcher blind to frees too; the same-address case is pinned by the gtests
    (WriteWatcher.AStorageFreedAndHandedBackAtItsAddressIsSeenReallocated, ...SeenFreedAtABlockBoundary...) and
    test_random_programs.py::test_the_refill_family_is_exact_whatever_address_the_refill_gets."""
    torch.manual_seed(0)
    model = nn.Sequential(_RefillBlock(), _RefillBlock(), _RefillBlock())
    ref = copy.deepcopy(model)
    _Resharding(model)
    _Resharding(ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    sac = tapesac.TapeSAC(model, blocks="*", policy="full", preserve=preserve, schedule=schedule)
    try:
        for step in range(4):
            x = torch.randn(4, 8)
            ref(x).pow(2).sum().backward()
            with sac.step():
                model(x).pow(2).sum().backward()
            assert sac.last_step.ops_replayed > 0
            assert_same_grads(model, ref, f"step {step}: ")
            for opt in opts:
                opt.step()
                opt.zero_grad()
    finally:
        sac.close()


@pytest.mark.parametrize("preserve", ["regions", "snapshots"])
@pytest.mark.parametrize("move", ["share_memory_", "resize_same"])
def test_a_reallocation_keeping_the_bytes_then_a_write_is_undone(preserve: str, move: str) -> None:
    """Note [a storage reallocated unseen], seen freed (replay/src/preserve.cpp): share_memory_() and a resize_ to the
    storage's own size copy its bytes into a new allocation. The write after it was taken for a refill (the bytes
    "fresh memory"), not saved, and the replay read the written weight (an adversarial test: gradients off by 0.2-0.4
    under both modes, with the move at another address and, since the watcher sees frees, at the same one too)."""
    torch.manual_seed(0)
    model = nn.Sequential(_RefillBlock(), _RefillBlock())
    ref = copy.deepcopy(model)

    def step(m: nn.Module) -> None:
        loss = m(torch.randn(4, 8)).pow(2).sum()
        w = m[0].l1.weight
        if move == "share_memory_":
            w.data.share_memory_()
        else:
            w.untyped_storage().resize_(w.untyped_storage().nbytes())
        w.data.mul_(1.5)  # no version moves: only the watcher sees it
        loss.backward()

    torch.manual_seed(1)
    step(ref)
    torch.manual_seed(1)
    _step_under_tapesac(model, step, preserve=preserve)
    assert_same_grads(model, ref)


class _BufferBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("c", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x) + self.c)  # the add saves nothing: only a replay reads c again


@pytest.mark.parametrize("refill", ["none", "zeros", "scaled", "same", "foreach_scaled", "index_scaled", "index_same"])
@pytest.mark.parametrize("preserve", ["regions", "snapshots", "keep", "off"])
def test_a_replay_reading_a_storage_emptied_unseen_refuses(preserve: str, refill: str) -> None:
    """Note [a storage reallocated unseen], read unfilled / refilled with other bytes: a buffer freed and reallocated
    between forward and backward (untyped_storage().resize_(0), resize_(n)) and not written again holds the
    allocator's bytes; refilled with zeros or a scaled copy (version kept, as FSDP2 does), other bytes than the
    forward's. Plain autograd never reads it; a replay read it silently (an adversarial test: gradients off by 12.7 and
    6.4). ReplayContractError now; refilled with the forward's bytes, exact; without replays (policy "none"), exact."""
    for policy in ("none", "full"):
        torch.manual_seed(0)
        model = nn.Sequential(_BufferBlock(), _BufferBlock())
        ref = copy.deepcopy(model)
        x = torch.randn(4, 8)

        def step(m: nn.Module) -> None:
            loss = m(x).pow(2).sum()
            c = m[0].c
            values = _emptied(c)
            if refill.startswith("foreach"):
                # one call refills several storages (FSDP2's split_with_sizes_copy): the first gets other bytes
                c1 = m[1].c
                values1 = _emptied(c1)
                with torch.autograd._unsafe_preserve_version_counter((c, c1)):
                    torch._foreach_copy_([c, c1], [values * 2, values1])
            elif refill.startswith("index"):  # a refill whose bytes the watcher cannot tell apart
                with torch.autograd._unsafe_preserve_version_counter(c):
                    c.index_copy_(0, torch.arange(c.numel()), values * (2 if refill == "index_scaled" else 1))
            elif refill != "none":
                with torch.autograd._unsafe_preserve_version_counter(c):
                    c.copy_({"zeros": values * 0, "scaled": values * 2, "same": values}[refill])
            loss.backward()

        step(ref)
        if policy == "full" and (refill not in ("same", "index_same") or preserve == "off"):
            with pytest.raises(tapesac.ReplayContractError, match="no longer the forward's|preserve"):
                _step_under_tapesac(model, step, preserve=preserve)
            continue
        _step_under_tapesac(model, step, policy=policy, preserve=preserve)
        assert_same_grads(model, ref)


class _FlatBlock(nn.Module):
    """Parameters that are views of one flat storage with gaps between them (a flat-parameter layout)."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.randn(64 + 4 + 8 + 4)
        self.w, self.b = nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0))
        with torch.no_grad():
            self.w.set_(flat.untyped_storage(), 0, (8, 8))
            self.b.set_(flat.untyped_storage(), 68, (8,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w + self.b) + x


def test_a_flat_buffer_refilled_without_its_gaps_is_exact() -> None:
    """A flat buffer freed and reallocated whose parameters' bytes are copied back, its gaps left unwritten: a replay
    reads only the parameters' bytes. The refill was required to cover the whole storage and every replay was refused
    (an adversarial test); now only the bytes a replay reads must have been written since."""
    torch.manual_seed(0)
    model = nn.Sequential(_FlatBlock(), _FlatBlock())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)

    def step(m: nn.Module) -> None:
        loss = m(x).pow(2).sum()
        for blk in m:
            bias = blk.b.detach().clone()
            weight = _emptied(blk.w)  # the whole flat storage, gaps included
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter((blk.w, blk.b)):
                blk.w.copy_(weight)
                blk.b.copy_(bias)
        loss.backward()

    step(ref)
    _step_under_tapesac(model, step)
    assert_same_grads(model, ref)
