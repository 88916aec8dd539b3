"""Issue 20: a block whose tape is the same as at its previous call reuses that call's keep/drop decision (Note
[Decisions reused], replay/decide.h); a block whose tape changed — a new sequence length, a data-dependent branch,
MoE routing, autocast switched on, a strided input — is decided afresh. Every step is bitwise equal to the run
without tapesac (reference_check), and BlockStats.decision_reused says which calls reused.

The step's inputs are chosen from the step number (reference_check seeds each step's inputs with 1000 + step), so the
tapesac run and the reference run get the same inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models as M
from conftest import reference_check


def _step() -> int:
    """The step number (0-based) reference_check runs: it seeds each step's inputs with 1000 + step and its loss with
    2000 + step."""
    return torch.initial_seed() % 1000


def _reused(stats: Any) -> list[int]:
    return [b.decision_reused for b in stats.blocks]


@pytest.mark.parametrize("policy", ["full", "op_set", "none"])
def test_a_steady_block_reuses_its_decision(policy: str) -> None:
    """Step 1 decides every call; steps 2-4 (same shapes, new values) reuse every call's decision, and the kept and
    dropped counts are those of the decided step."""
    pol: Any = {"aten::addmm"} if policy == "op_set" else policy
    res = reference_check(lambda: M.stack(3), lambda: (M.x_in(),), pol, "blocks.*", steps=4, block_calls=3,
                          expect_drop=policy != "none" or None,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
    first, *later = res.all_stats
    assert _reused(first) == [0, 0, 0], f"step 1 had no earlier decision to reuse: {first.blocks}"
    for st in later:
        assert _reused(st) == [1, 1, 1], f"step {st.step}: a steady block decided again: {_reused(st)}"
        assert st.decision_reused == 3
        for a, b in zip(st.blocks, first.blocks):
            assert (a.kept_tensors, a.dropped_tensors, a.kept_bytes, a.dropped_bytes) == \
                   (b.kept_tensors, b.dropped_tensors, b.kept_bytes, b.dropped_bytes), (a, b)


class _Branchy(nn.Module):
    """A data-dependent branch: relu or tanh path chosen from the input's sign."""

    def __init__(self, d: int = M.D):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if bool(x.sum() > 0):
            return self.fc2(torch.relu(h)) + x
        return self.fc2(torch.tanh(h) * torch.sigmoid(h)) + x


class _TinyMoE(nn.Module):
    """Top-1 routing over 3 experts: which tokens go where (and how many) depends on the values."""

    def __init__(self, d: int = M.D, experts: int = 3):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(M.MLPBlock(d, d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            if idx.numel():
                out = out.index_add(0, idx, expert(flat[idx]))
        return out.view_as(x) + x


def _inputs(kind: str) -> tuple[torch.Tensor, ...]:
    """This step's input for a test of kind `kind`: steps 0-1 and 3 alike, step 2 different (a changed tape)."""
    s = _step()
    changed = s == 2
    if kind == "seq_len":
        return (torch.randn(M.B, M.T + (4 if changed else 0), M.D, requires_grad=True),)
    if kind == "branch":
        x = torch.randn(M.B, M.T, M.D).abs()
        return ((-x if changed else x).requires_grad_(),)
    if kind == "strided":
        if changed:  # the same shape, other strides: [B, T, D] viewed from a [T, B, D] tensor
            return (torch.randn(M.T, M.B, M.D).transpose(0, 1).detach().requires_grad_(),)
        return (torch.randn(M.B, M.T, M.D, requires_grad=True),)
    if kind == "moe":
        torch.manual_seed(7 if changed else 5)  # same routing on steps 0, 1, 3
        return (torch.randn(M.B, M.T, M.D, requires_grad=True),)
    if kind == "autocast":
        return (torch.randn(M.B, M.T, M.D, requires_grad=True),)
    raise KeyError(kind)


def _autocast_loss(model: nn.Module, inputs: Any) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_step() == 2):
        out = model(*inputs)
    return out.float().square().mean()


def _plain_loss(model: nn.Module, inputs: Any) -> torch.Tensor:
    return model(*inputs).square().mean()


_MODELS = {
    "seq_len": lambda: M.Stack([M.AttentionBlock(), M.MLPBlock()]),
    "branch": lambda: M.Stack([_Branchy(), _Branchy()]),
    "strided": lambda: M.Stack([M.MLPBlock(), M.MLPBlock()]),
    "moe": lambda: M.Stack([_TinyMoE(), _TinyMoE()]),
    "autocast": lambda: M.Stack([M.MLPBlock(), M.MLPBlock()]),
}


@pytest.mark.parametrize("kind", list(_MODELS))
@pytest.mark.parametrize("policy", ["full", "op_set"])
def test_a_changed_tape_is_decided_afresh(kind: str, policy: str) -> None:
    """Step 3's tape differs (kind): the first block decides afresh there and stays exact; step 4 is like step 2
    again and differs from step 3, so it decides afresh too; step 2 (like step 1) reuses."""
    pol: Any = {"aten::addmm", "aten::mm"} if policy == "op_set" else policy
    res = reference_check(_MODELS[kind], lambda: _inputs(kind), pol, "blocks.*", steps=4,
                          loss_fn=_autocast_loss if kind == "autocast" else _plain_loss, expect_drop=None,
                          optimizer=None)
    reused = [_reused(st) for st in res.all_stats]
    assert reused[0] == [0, 0], reused
    if kind != "moe":  # the MoE's routing follows its weights' values too: steps 1 and 2 agree by the seed only
        assert reused[1][0] == 1, f"{kind}: step 2 has step 1's tape and did not reuse its decision: {reused}"
    assert reused[2][0] == 0, f"{kind}: step 3's tape changed and its decision was reused: {reused}"
    assert reused[3][0] == 0, f"{kind}: step 4's tape differs from step 3's and its decision was reused: {reused}"
    assert any(st.dropped_tensors > 0 for st in res.all_stats), "nothing was dropped: the test checks nothing"


def test_a_block_called_twice_in_a_step_reuses_the_first_calls_decision() -> None:
    """The same block called twice per step on same-shaped inputs (weight sharing): its second call reuses."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([M.MLPBlock()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[0](F.gelu(self.blocks[0](x)))

    res = reference_check(Twice, lambda: (M.x_in(),), "full", "blocks.*", steps=2, block_calls=2)
    assert _reused(res.all_stats[0]) == [0, 1], res.all_stats[0].blocks
    assert _reused(res.all_stats[1]) == [1, 1], res.all_stats[1].blocks


def test_a_new_plan_is_not_served_an_old_decision() -> None:
    """Policy "auto": the measuring step runs "full"; the first planned step decides under the plan (its mask is part
    of the key), never with the measuring step's decision; later steps under the same plan reuse; all exact."""
    make = lambda: M.Stack([M.MLPBlock(), M.MLPBlock(), M.MLPBlock()])  # noqa: E731
    torch.manual_seed(0)
    probe = make()
    import tapesac

    sac = tapesac.TapeSAC(probe, blocks="blocks.*", policy="none")
    try:
        with sac.step():
            probe(M.x_in()).square().mean().backward()
        none_peak = sac.last_step.memory.peak_bytes
    finally:
        sac.close()
    # Twice the first step's no-checkpoint peak: the plan keeps everything. (At that peak itself auto refuses, rightly:
    # without an optimizer the gradients accumulate, so later steps hold step 1's too — test_user_holes.py,
    # test_auto_does_not_count_kept_gradients_as_its_models_error.)
    res = reference_check(make, lambda: (M.x_in(),), "auto", "blocks.*", steps=4, expect_drop=False,
                          sac_kwargs={"memory_limit": 2 * none_peak})
    plans = [st.blocks[0].planned for st in res.all_stats]
    assert plans == [False, True, True, True], f"step 1 measures, steps 2-4 run the plan: {plans}"
    reused = [_reused(st) for st in res.all_stats]
    assert reused[1] == [0, 0, 0], f"the first planned step reused the measuring step's decisions: {reused}"
    assert reused[3] == [1, 1, 1], f"steps under one plan did not reuse: {reused}"
    kept = [st.kept_tensors for st in res.all_stats]
    assert kept[1] > kept[0] and res.all_stats[1].dropped_tensors == 0, f"the plan keeps everything: {kept}"
