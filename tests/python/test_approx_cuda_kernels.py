"""Approximate attention on the CUDA SDPA kernels' signatures, on CPU (issue 17 item 9).

On a GPU a bf16/fp16 HF model's attention runs ``aten::_scaled_dot_product_flash_attention`` or
``aten::_scaled_dot_product_efficient_attention`` (or cuDNN's), not the CPU flash kernel. Those ops have no CPU
kernels; this file registers CPU stand-ins with their exact schemas (torch.library, for the duration of a test): a
forward returning the attention, its logsumexp (the efficient kernel's padded to a multiple of 32 along the
sequence, as on CUDA) and the kernel's other outputs, and a backward that rebuilds the probabilities as
exp(scores - logsumexp) from the saved logsumexp, as the CUDA kernels do. HF's SDPA call is routed to the op under
test. Then the attention matcher must find the component (approx_attn), and the sketch must stay unbiased: the mean
of many per-step gradient estimates is within its own standard error of the exact gradient (test_approx.py's
statistic), which holds only if the logsumexp shift by -log(w) reaches the kernel's backward.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from models import hf_llama, hf_loss
from test_approx import _bias_statistic, _ids

pytestmark = pytest.mark.usefixtures("one_thread")

_REAL_SDPA = F.scaled_dot_product_attention
CALLS: dict[str, int] = {}  # stand-in calls by kernel


def _scores(q, k, attn_bias, is_causal, scale):
    if k.shape[1] != q.shape[1]:  # grouped-query: each kv head serves heads/kv_heads query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if attn_bias is not None:
        s = s + attn_bias
    if is_causal:
        t, u = s.shape[-2:]
        s = s.masked_fill(torch.ones(t, u, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _expand(x, heads):
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _fold(g, kv_heads):
    """Sums a gradient over the query heads sharing each kv head."""
    b, h, t, d = g.shape
    return g.reshape(b, kv_heads, h // kv_heads, t, d).sum(2) if h != kv_heads else g


def _forward(q, k, v, attn_bias, is_causal, scale):
    s = _scores(q, k, attn_bias, is_causal, scale)
    lse = torch.logsumexp(s, -1)  # [B, H, T]
    out = torch.softmax(s, -1) @ _expand(v, q.shape[1])
    return out, lse


def _backward(grad_out, q, k, v, attn_bias, out, lse, is_causal, scale):
    """The kernels' backward: probabilities from the saved logsumexp, D = rowsum(dO * O)."""
    t = q.shape[-2]
    s = _scores(q, k, attn_bias, is_causal, scale)
    p = torch.exp(s - lse[..., :t].unsqueeze(-1))
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ve, ke = _expand(v, q.shape[1]), _expand(k, q.shape[1])
    dv = p.transpose(-2, -1) @ grad_out
    dp = grad_out @ ve.transpose(-2, -1)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    dq = (ds @ ke) * sc
    dk = (ds.transpose(-2, -1) @ q) * sc
    return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1]), ds


def efficient_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert dropout_p == 0.0
    out, lse = _forward(q, k, v, attn_bias, is_causal, scale)
    pad = -lse.shape[-1] % 32  # the CUDA kernel's logsumexp is [B, H, ceil(T / 32) * 32]
    lse = F.pad(lse, (0, pad), value=float("inf")) if compute_log_sumexp else lse.new_empty(0)
    return out, lse, torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def efficient_bwd(grad_out, q, k, v, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                  grad_input_mask, is_causal=False, *, scale=None):
    dq, dk, dv, ds = _backward(grad_out, q, k, v, attn_bias, out, logsumexp, is_causal, scale)
    return dq, dk, dv, (ds if grad_input_mask[3] else None)


def flash_fwd(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0.0
    out, lse = _forward(q, k, v, None, is_causal, scale)
    e = q.new_empty(0)
    return out, lse, e, e, q.shape[-2], k.shape[-2], torch.empty(2, dtype=torch.long), e, e


def flash_bwd(grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
              philox_seed, philox_offset, *, scale=None):
    dq, dk, dv, _ = _backward(grad_out, q, k, v, None, out, logsumexp, is_causal, scale)
    return dq, dk, dv


KERNELS = {
    "efficient": ("_scaled_dot_product_efficient_attention", efficient_fwd,
                  "_scaled_dot_product_efficient_attention_backward", efficient_bwd),
    "flash": ("_scaled_dot_product_flash_attention", flash_fwd,
              "_scaled_dot_product_flash_attention_backward", flash_bwd),
}


@pytest.fixture
def cuda_kernel_on_cpu(request, monkeypatch):
    """Registers the CPU stand-ins of the kernel named by the test's `kernel` parameter and routes
    F.scaled_dot_product_attention to it (HF looks the function up at each call)."""
    kernel = request.node.callspec.params["kernel"]
    fwd_name, fwd, bwd_name, bwd = KERNELS[kernel]
    lib = torch.library.Library("aten", "IMPL")
    lib.impl(fwd_name, fwd, "CPU")
    lib.impl(bwd_name, bwd, "CPU")
    op = getattr(torch.ops.aten, fwd_name)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        CALLS[kernel] = CALLS.get(kernel, 0) + 1
        if kernel == "flash":
            assert attn_mask is None or is_causal, "the flash kernel takes no mask"
            return op(q, k, v, dropout_p, is_causal or attn_mask is not None, scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
        return op(q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    yield fwd_name
    del lib  # deregisters the CPU kernels


def _samples(reweight: bool, n: int, fwd_name: str):
    import tapesac

    torch.manual_seed(0)
    model = hf_llama(1)
    ids = _ids(1)
    ref = copy.deepcopy(model)
    hf_loss(ref, ids).backward()
    exact = torch.cat([p.grad.flatten() for p in ref.parameters()]).double()
    seen = tapesac.record_ops(lambda: hf_loss(model, ids))
    assert f"aten::{fwd_name}" in seen, sorted(seen)
    model.zero_grad(set_to_none=True)
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full", approx=tapesac.Approx(fraction=0.5))
    sac._session.set_approx(0.5, "sketch", mlp=False, attn=True, seed=0, reweight=reweight)
    samples = []
    try:
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            with sac.step():
                hf_loss(model, ids).backward()
            samples.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
        st = sac.last_step
        assert st.approx_attn == 1, "the attention matcher did not match the kernel"
        assert 0 < st.approx_heads_recomputed < st.approx_heads_total
    finally:
        sac.close()
    return torch.stack(samples), exact


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_stand_in_kernels_match_the_cpu_kernel(kernel, cuda_kernel_on_cpu, monkeypatch) -> None:
    """The stand-ins are right: a training step through them gives the CPU SDPA's loss and gradients."""
    torch.manual_seed(0)
    model = hf_llama(1)
    ref = copy.deepcopy(model)
    ids = _ids(1)
    before = CALLS.get(kernel, 0)
    loss = hf_loss(model, ids)
    loss.backward()
    assert CALLS.get(kernel, 0) == before + 1, "HF did not call the routed SDPA"
    monkeypatch.setattr(F, "scaled_dot_product_attention", _REAL_SDPA)
    ref_loss = hf_loss(ref, ids)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_attention_sketch_is_unbiased_on_the_cuda_kernels(kernel, cuda_kernel_on_cpu) -> None:
    samples, exact = _samples(reweight=True, n=200, fwd_name=cuda_kernel_on_cpu)
    assert not torch.allclose(samples[0], exact), "a single estimate equals the exact gradient: nothing approximated"
    stat = _bias_statistic(samples, exact)
    assert stat < 4.0, f"mean of 200 sketch estimates is {stat:.2f} standard errors^2 from the exact gradient"


@pytest.mark.parametrize("kernel", ["efficient"])
def test_attention_sketch_without_reweighting_is_biased_on_the_efficient_kernel(kernel, cuda_kernel_on_cpu) -> None:
    samples, exact = _samples(reweight=False, n=200, fwd_name=cuda_kernel_on_cpu)
    stat = _bias_statistic(samples, exact)
    assert stat > 40.0, f"without 1/p reweighting (and the logsumexp shift) the bound should be violated, got {stat:.2f}"
