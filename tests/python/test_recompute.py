"""Recompute is counted, not assumed.

Three variants run the same model on the same inputs: (a) no checkpointing, (b) torch.utils.checkpoint
(non-reentrant) per block, (c) tapesac "full". During loss.backward() a TorchDispatchMode counts ops by name and
FlopCounterMode counts FLOPs; both see recomputation (checkpoint reruns Python under the mode; tapesac replays below
autograd through the dispatcher, which still reaches the Python dispatch key). recompute = count(b or c) - count(a).

`aten::detach` is not counted: while a Python mode is active, autograd saving an output dispatches an extra
detach (checkpoint's recompute runs under autograd and saves; tapesac's replay does not), so counting it would
only measure the mode. It has no FLOPs.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import models as M
from conftest import assert_same_grads, assert_same_tensor

NOT_COUNTED = {"aten::detach"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        s = func._schema
        name = s.name + ("." + s.overload_name if s.overload_name else "")
        if name not in NOT_COUNTED:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class CheckpointedStack(nn.Module):
    """Runs a Stack's blocks, each under non-reentrant torch.utils.checkpoint."""

    def __init__(self, stack: M.Stack):
        super().__init__()
        self.blocks = stack.blocks

    def forward(self, x):
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return x


def count_backward(forward: Callable[[], torch.Tensor], step=None):
    """Forward outside the counters, backward inside them. Returns (loss, op counts, total FLOPs)."""
    import contextlib

    with (step if step is not None else contextlib.nullcontext()):
        loss = forward()
        with OpCounter() as oc, FlopCounterMode(display=False) as fc:
            loss.backward()
    return loss, oc.counts, fc.get_total_flops()


def diff(counts: Counter, base: Counter) -> Counter:
    out = Counter()
    for k in set(counts) | set(base):
        d = counts[k] - base[k]
        if d:
            out[k] = d
    return out


def fmt(c: Counter) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(c.items())) or "(none)"


def run_three(make_model, make_input, loss_fn, blocks_spec, checkpointed: Callable[[nn.Module], nn.Module]):
    import tapesac

    torch.manual_seed(0)
    base = make_model()
    ck = copy.deepcopy(base)
    sac_model = copy.deepcopy(base)
    ck_wrapped = checkpointed(ck)

    torch.manual_seed(1)
    xa = make_input()
    torch.manual_seed(1)
    xb = make_input()
    torch.manual_seed(1)
    xc = make_input()

    torch.manual_seed(2)
    loss_a, ops_a, flops_a = count_backward(lambda: loss_fn(base, xa))
    torch.manual_seed(2)
    loss_b, ops_b, flops_b = count_backward(lambda: loss_fn(ck_wrapped, xb))
    sac = tapesac.TapeSAC(sac_model, blocks=blocks_spec, policy="full")
    try:
        torch.manual_seed(2)
        loss_c, ops_c, flops_c = count_backward(lambda: loss_fn(sac_model, xc), step=sac.step())
        stats = sac.last_step
    finally:
        sac.close()

    # (b) and (c) are exact: same loss and gradients as (a).
    assert_same_tensor("checkpoint loss", loss_b.detach(), loss_a.detach())
    assert_same_tensor("tapesac loss", loss_c.detach(), loss_a.detach())
    assert_same_grads(ck, base, "checkpoint: ")
    assert_same_grads(sac_model, base, "tapesac: ")
    if isinstance(xa, torch.Tensor) and xa.requires_grad:
        assert_same_tensor("checkpoint input grad", xb.grad, xa.grad)
        assert_same_tensor("tapesac input grad", xc.grad, xa.grad)

    rec_b, rec_c = diff(ops_b, ops_a), diff(ops_c, ops_a)
    assert all(v > 0 for v in rec_b.values()), f"checkpoint ran fewer ops in backward than the baseline: {rec_b}"
    assert all(v > 0 for v in rec_c.values()), f"tapesac ran fewer ops in backward than the baseline: {rec_c}"
    return dict(rec_b=rec_b, rec_c=rec_c, flops_b=flops_b - flops_a, flops_c=flops_c - flops_a, stats=stats,
                flops_a=flops_a)


def report(title: str, r: dict) -> None:
    print(f"\n[{title}] recompute during backward (ops beyond the no-checkpoint baseline)")
    print(f"  checkpoint : {sum(r['rec_b'].values())} ops, {r['flops_b']} FLOPs: {fmt(r['rec_b'])}")
    print(f"  tapesac    : {sum(r['rec_c'].values())} ops, {r['flops_c']} FLOPs: {fmt(r['rec_c'])}")
    print(f"  baseline backward FLOPs: {r['flops_a']}; tapesac ops_replayed_by_name: "
          f"{fmt(Counter(r['stats'].ops_replayed_by_name))}")


NBLK = 3


def test_wasteful_block_tapesac_recomputes_strictly_less() -> None:
    r = run_three(lambda: M.Stack([M.WastefulBlock() for _ in range(NBLK)]),
                  lambda: torch.randn(M.B * M.T, M.D, requires_grad=True),
                  lambda m, x: m(x).square().mean(), "blocks.*", CheckpointedStack)
    report("WastefulBlock x3", r)
    rec_b, rec_c = r["rec_b"], r["rec_c"]
    assert sum(rec_c.values()) > 0 and r["flops_c"] > 0, "tapesac recomputed nothing: nothing was dropped?"
    assert sum(rec_c.values()) < sum(rec_b.values()), (fmt(rec_c), fmt(rec_b))
    assert r["flops_c"] < r["flops_b"], (r["flops_c"], r["flops_b"])
    # Exactly the producers of saved values: fc1 and gate matmuls, gelu and sigmoid, once per block. Never the
    # branch matmul or the trailing fc2 matmul, whose outputs nobody saved.
    assert rec_c["aten::addmm"] == 2 * NBLK, fmt(rec_c)
    assert rec_c["aten::gelu"] == NBLK and rec_c["aten::sigmoid"] == NBLK, fmt(rec_c)
    assert rec_b["aten::addmm"] == 4 * NBLK, f"checkpoint is expected to rerun all 4 matmuls: {fmt(rec_b)}"
    # tapesac's own replay counts agree with what the dispatcher saw.
    by_name = r["stats"].ops_replayed_by_name
    for op in ("aten::addmm", "aten::gelu", "aten::sigmoid"):
        assert by_name.get(op, 0) == rec_c[op], (op, by_name, fmt(rec_c))


def test_mlp_trailing_matmul_never_replayed() -> None:
    """y = fc2(gelu(fc1(x))): replay needs fc1's output and gelu's output, never fc2's matmul (trap 1)."""
    r = run_three(lambda: M.Stack([M.MLPBlock() for _ in range(NBLK)]),
                  lambda: torch.randn(M.B * M.T, M.D, requires_grad=True),
                  lambda m, x: m(x).square().mean(), "blocks.*", CheckpointedStack)
    report("MLPBlock x3", r)
    rec_c = r["rec_c"]
    assert rec_c["aten::addmm"] == NBLK and rec_c["aten::gelu"] == NBLK, fmt(rec_c)
    assert sum(rec_c.values()) <= sum(r["rec_b"].values()) and r["flops_c"] <= r["flops_b"]


def _hf_checkpointed(model: nn.Module) -> nn.Module:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    return model


@pytest.mark.parametrize("family", ["qwen3"])
def test_hf_model_tapesac_recomputes_no_more_than_checkpoint(family: str) -> None:
    r = run_three(lambda: M.HF_MODELS[family](3).train(),
                  lambda: torch.randint(0, M.HF_VOCAB, (M.B, M.T)),
                  M.hf_loss, "model.layers.*", _hf_checkpointed)
    report(f"HF {family} tiny, 3 layers", r)
    assert sum(r["rec_c"].values()) > 0 and r["flops_c"] > 0, "tapesac recomputed nothing"
    assert sum(r["rec_c"].values()) <= sum(r["rec_b"].values()), (fmt(r["rec_c"]), fmt(r["rec_b"]))
    assert r["flops_c"] <= r["flops_b"], (r["flops_c"], r["flops_b"])
