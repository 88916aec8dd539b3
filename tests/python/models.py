"""Small models for the tapesac end-to-end tests.

Contract: every constructor here is deterministic given `torch.manual_seed`; every model is tiny
(hidden 64-128, 2-3 blocks) so the whole pytest suite runs on two CPU cores in a few minutes.
Block containers expose their blocks as `blocks` (an nn.ModuleList), so `blocks="blocks.*"` selects them;
HF models expose theirs as `model.layers`, so `blocks="model.layers.*"` selects them.

Shapes are written as [B, T, D] (batch, sequence, hidden).
"""

from __future__ import annotations

import os

# Offline before transformers is imported anywhere (conftest does the same; this keeps `models` importable alone).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

D = 64  # default hidden size
T = 16  # default sequence length
B = 2  # default batch


# ----------------------------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """y = fc2(gelu(fc1(x))): gelu saves fc1's output, fc2 saves gelu's output."""

    def __init__(self, d: int = D, hidden: int = 2 * D, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class AttentionBlock(nn.Module):
    """Pre-projection causal self-attention with SDPA, residual and LayerNorm.

    x [B, T, D] -> qkv [B, T, 3D] -> q, k, v [B, H, T, D/H] -> SDPA -> [B, T, D] -> out proj -> LayerNorm(x + .)
    """

    def __init__(self, d: int = D, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # 3 x [B, T, D], views
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # [B, H, T, D/H]
        a = a.transpose(1, 2).reshape(b, t, d)
        return self.norm(x + self.proj(a))


class DropoutBlock(nn.Module):
    """Random ops: nn.Dropout, functional dropout and a rand_like mask saved by a mul."""

    def __init__(self, d: int = D, p: float = 0.3):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * d, d)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.fc1(x)))  # the mask is saved by native_dropout's backward
        keep = (torch.rand_like(h) > 0.2).to(h.dtype)  # a random mask produced by a plain random op
        h = torch.tanh(h * keep)  # mul saves `keep`, tanh saves its result
        h = F.dropout(h, p=self.p, training=self.training)
        return self.fc2(h)


class RandomOpsBlock(nn.Module):
    """Many kinds of random ops (tagged nondeterministic_seeded): bernoulli, randn_like, exponential_, multinomial,
    and nn.RReLU, whose rrelu_with_noise fills its `noise` argument in place."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.rrelu = nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.fc1(x)
        m = torch.bernoulli(torch.full_like(h, 0.7))  # saved by the mul below
        e = torch.empty_like(h).exponential_()
        h = (h * m + 0.1 * torch.randn_like(h)) * e
        h = self.rrelu(h)  # random slopes for negatives; the noise is saved for backward
        probs = torch.softmax(h.detach().reshape(b * t, d), dim=-1)
        idx = torch.multinomial(probs, 2)  # [B*T, 2], saved by gather's backward
        picked = torch.gather(h.reshape(b * t, d), 1, idx).sum(-1).reshape(b, t, 1)
        return self.fc2(torch.tanh(h)) + picked


class BatchNormBlock(nn.Module):
    """BatchNorm in training mode: running stats and num_batches_tracked must advance exactly once per call."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.bn(self.fc1(x).reshape(b * t, d)).reshape(b, t, d)
        return self.fc2(F.gelu(h))


class InplaceBlock(nn.Module):
    """In-place ops on intermediates: relu_, add_, mul_ (its autograd saves a clone of the original) and add_ on a
    narrow() view of an intermediate."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.bias2 = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.relu_()  # in place on fc1's output; relu_'s backward saves the mutated h
        g = self.fc2(h)  # saves h (version 1)
        g.add_(self.bias2)  # in place, saves nothing
        g.mul_(torch.sigmoid(x))  # saves the sigmoid and a clone of g before the mul
        g.narrow(-1, 0, g.shape[-1] // 2).add_(torch.tanh(x.narrow(-1, 0, x.shape[-1] // 2)))  # add_ on a view
        return g * g  # saves g at its final version


class ViewBlock(nn.Module):
    """Views: split, view, reshape, transpose, narrow, unsqueeze/squeeze, and a view of the block input."""

    def __init__(self, d: int = D, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(d // 2, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.fc1(x)  # [B, T, 2D]
        a, c = h.split(d, dim=-1)  # views [B, T, D]
        a = a.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)  # [B, H, T, D/H]
        c = c.unsqueeze(0).squeeze(0).reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        s = torch.tanh(a) * torch.sigmoid(c)  # [B, H, T, D/H]
        s = s.transpose(1, 2).reshape(b, t, d)  # [B, T, D]
        xv = x.view(b * t, d).view(b, t, d)  # a view of the block input
        left = s.narrow(-1, 0, d // 2)  # [B, T, D/2], a view
        return self.fc2(left * xv.narrow(-1, d // 2, d // 2)) + x


class AliasBlock(nn.Module):
    """Returns a view of its input (no compute): the tape has only view ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-1, -2).transpose(-1, -2)


class MultiOutputBlock(nn.Module):
    """Multi-output ops: var_mean, chunk, topk, max(dim); some outputs unused."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # [B, T, 2D]
        var, mean = torch.var_mean(h, dim=-1, keepdim=True)
        hn = (h - mean) * torch.rsqrt(var + 1e-5)
        a, c = hn.chunk(2, dim=-1)  # [B, T, D] each
        vals, _idx = torch.topk(a, k=4, dim=-1)  # indices unused by the caller, saved by topk's backward
        mx, _argmx = torch.max(c, dim=-1, keepdim=True)
        g = a * torch.sigmoid(c)
        return self.fc2(g) + vals.sum(-1, keepdim=True) + mx


class KwargsBlock(nn.Module):
    """Keyword-only, non-tensor and tensor keyword arguments."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None, flag: bool = True,
                names: tuple[str, ...] = ("a",)) -> torch.Tensor:
        h = self.fc1(x) * scale
        if mask is not None:
            h = h * mask  # mask [T, D] may require grad: it must receive its gradient
        h = F.gelu(h) if flag else torch.tanh(h)
        if "b" in names:
            h = h * torch.sigmoid(h)
        return self.fc2(h) * float(len(names))


class NoGradBlock(nn.Module):
    """Tensors computed under torch.no_grad() inside the block, then used (and saved) by grad-tracking ops."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            norm = x.abs().amax(dim=-1, keepdim=True) + 1.0  # a normaliser, no grad
            mask = (self.fc1(x) > 0).to(x.dtype)  # a mask computed with the block's own parameters, no grad
        h = self.fc1(x) / norm  # div saves `norm`
        h = F.gelu(h) * mask  # mul saves `mask`
        return self.fc2(h)


class TupleOutBlock(nn.Module):
    """Returns (main, aux); callers ignore aux, so aux's producers must never be replayed."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.aux = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        main = torch.tanh(self.fc1(x))
        aux = torch.sigmoid(self.aux(x)) * main
        return main, aux


class SharedParamBlock(nn.Module):
    """A block using an nn.Linear that another block uses too."""

    def __init__(self, shared: nn.Linear, d: int = D):
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(F.gelu(self.shared(x)))


class WastefulBlock(nn.Module):
    """Producers that feed no saved tensor.

    `branch` and the last matmul of `fc2(gelu(fc1(x)))` produce values that are only summed into the output:
    their inputs are saved but nothing needs re-running them. The last saved tensor (the sigmoid gate, saved by
    square) is produced after them, so whole-block recomputation runs them again, pruned replay does not.
    """

    def __init__(self, d: int = D, hidden: int = 4 * D):
        super().__init__()
        self.branch = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.gate = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.branch(x)  # wasted on recompute: output only summed
        a = F.gelu(self.fc1(x))  # gelu saves fc1's output
        y = self.fc2(a)  # saves a; y is only summed: wasted on recompute
        g = torch.sigmoid(self.gate(x))  # sigmoid saves g
        return y + b + g.square()  # square saves g: the last saved tensor


class FailingBlock(MLPBlock):
    """An MLP block that raises `self.error` (after running some ops) when `self.fail` is set."""

    def __init__(self, d: int = D):
        super().__init__(d)
        self.fail = False
        self.error = ValueError("boom from FailingBlock.forward")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.fail:
            raise self.error
        return self.fc2(h)


class WeakrefMLPBlock(nn.Module):
    """An MLP block that records weak references to the *storages* of its input and intermediates in `self.refs`.

    Storage-level (StorageWeakRef.expired() is true once the memory is released), not Python-object-level: a
    runtime may legitimately hold a tensor through another TensorImpl (a detached alias) that shares the storage,
    so the Python tensor object dying says nothing about the memory.
    """

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.refs: list[tuple[str, StorageWeakRef]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # saved by gelu
        a = F.gelu(h)  # saved by fc2
        y = self.fc2(a)
        self.refs += [(k, StorageWeakRef(t.untyped_storage())) for k, t in (("input", x), ("fc1_out", h),
                                                                            ("gelu_out", a))]
        return y


# ----------------------------------------------------------------------------------------------------------------------
# Containers
# ----------------------------------------------------------------------------------------------------------------------


class Stack(nn.Module):
    """x -> blocks[0] -> blocks[1] -> ...; `blocks="blocks.*"` selects every block."""

    def __init__(self, blocks: list[nn.Module] | nn.ModuleList):
        super().__init__()
        self.blocks = blocks if isinstance(blocks, nn.ModuleList) else nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


class KwargsStack(nn.Module):
    """Calls KwargsBlocks with keyword-only, non-tensor and tensor keyword arguments."""

    def __init__(self, n: int = 3, d: int = D):
        super().__init__()
        self.blocks = nn.ModuleList(KwargsBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            if i % 2 == 0:
                x = blk(x, scale=0.5 + i, mask=mask, flag=True, names=("a", "b"))
            else:
                x = blk(x, scale=2.0, flag=False)  # defaults for mask and names
        return x


class UnusedOutputModel(nn.Module):
    """blocks[1]'s output never reaches the loss; blocks[2] returns (main, aux) and aux is dropped."""

    def __init__(self, d: int = D):
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(d), MLPBlock(d), TupleOutBlock(d), MLPBlock(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        self.blocks[1](h)  # output discarded
        main, _aux = self.blocks[2](h)
        return self.blocks[3](main)


def shared_param_stack(d: int = D) -> Stack:
    shared = nn.Linear(d, d)
    return Stack([SharedParamBlock(shared, d), MLPBlock(d), SharedParamBlock(shared, d)])


# ----------------------------------------------------------------------------------------------------------------------
# HF tiny models (random weights, built from configs; never from_pretrained)
# ----------------------------------------------------------------------------------------------------------------------

HF_VOCAB = 256

_HF_COMMON = dict(
    vocab_size=HF_VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=64,
    use_cache=False,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)


def hf_llama(layers: int = 2, **overrides) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**_HF_COMMON, "num_hidden_layers": layers, **overrides}))


def hf_qwen3(layers: int = 2, **overrides) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**{**_HF_COMMON, "num_hidden_layers": layers, **overrides}))


def hf_qwen3_moe(layers: int = 2, **overrides) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**_HF_COMMON, **cfg, "num_hidden_layers": layers, **overrides}))


HF_MODELS: dict[str, Callable[..., nn.Module]] = {
    "llama": hf_llama,
    "qwen3": hf_qwen3,
    "qwen3_moe": hf_qwen3_moe,
}


def hf_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids, labels=input_ids).loss


def hf_layer_kwargs(model: nn.Module, hidden: torch.Tensor, attention_mask_2d: torch.Tensor | None = None) -> dict:
    """The keyword arguments the HF 5.x model loop passes to each decoder layer (besides hidden_states).

    Mirrors e.g. transformers/models/qwen3/modeling_qwen3.py `Qwen3Model.forward`.
    """
    from transformers.masking_utils import create_causal_mask

    t = hidden.shape[1]
    position_ids = torch.arange(t, device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask_2d,
                              cache=None, position_ids=position_ids)
    position_embeddings = model.model.rotary_emb(hidden, position_ids)
    return dict(attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids,
                cache=None, use_cache=False)


def stack(n: int = 2) -> "Stack":
    """A seeded Stack of n MLPBlocks: the smallest model most API tests need."""
    torch.manual_seed(0)
    return Stack([MLPBlock() for _ in range(n)])


def x_in() -> torch.Tensor:
    """An input for stack(): [B, T, D], requiring grad."""
    return torch.randn(B, T, D, requires_grad=True)
