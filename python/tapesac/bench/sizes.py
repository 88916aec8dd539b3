# tapesac.bench.sizes — the models the suite trains: sizes, builders, and one workload (a model and its batch).
#
# Contract:
# - `SIZES[name]` is a frozen `Size`: input batch [batch, seq], dtype, device, and builder kwargs shared by the
#   architectures (`common`) plus per-architecture overrides. `ARCHS` names the architectures.
# - `build_model(arch, size, seed)` builds a freshly initialised HF model from a config (tapesac.models: random
#   weights from `seed`, nothing downloaded), in train mode, on the size's device and dtype. An unknown arch raises
#   SystemExit with the accepted names.
# - `Workload`: one model and one batch that every variant of a run trains; `pristine` is a deep copy taken before
#   any step (for variants that need their own model).
# - `model_bytes(model)`: bytes of the distinct parameters and buffers, the CPU step baseline.
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

MiB = float(2**20)
ARCHS = ("qwen3", "qwen3_moe", "llama")


@dataclass(frozen=True, kw_only=True)
class Size:
    """One model size: builder kwargs shared by the architectures plus per-architecture overrides.

    batch, seq: the input batch [batch, seq] of random token ids.
    dtype: parameter dtype. device: "cpu" or "cuda".
    common: kwargs for every builder in tapesac.models; qwen3 / llama / moe: extra kwargs per architecture.
    note: what the size is for (printed).
    """

    batch: int
    seq: int
    common: dict[str, Any]
    qwen3: dict[str, Any] = field(default_factory=dict)
    llama: dict[str, Any] = field(default_factory=dict)
    moe: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"
    note: str = ""


SIZES: dict[str, Size] = {
    "smoke": Size(
        batch=2, seq=32, note="CI smoke: seconds",
        common=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    ),
    "demo": Size(
        batch=8, seq=128, note="the model of `python -m tapesac demo`",
        common=dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2),
    ),
    "small": Size(
        batch=4, seq=256, note="CPU: a step well under a second",
        common=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        qwen3=dict(intermediate_size=768),
        moe=dict(intermediate_size=768, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2),
    ),
    "medium": Size(
        batch=4, seq=256, note="CPU: matrix products dominate",
        common=dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64),
        qwen3=dict(intermediate_size=1536),
        moe=dict(intermediate_size=1536, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2),
    ),
    # peers.md §5.1 H200 recipe: Qwen3 ~1B (V32000, tied), TinyLlama shape, a ~1B-total Qwen3-MoE; bf16, seq 4096.
    "gpu1b": Size(
        batch=4, seq=4096, dtype="bfloat16", device="cuda", note="GPU: about 1B parameters at sequence 4096",
        common=dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=8, max_position_embeddings=4096),
        qwen3=dict(head_dim=128, intermediate_size=6144),
        llama=dict(num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632),
        moe=dict(num_hidden_layers=12, moe_intermediate_size=1536, num_experts=8, num_experts_per_tok=2),
    ),
}


def build_model(arch: str, size: Size, seed: int = 0) -> nn.Module:
    """A freshly initialised HF model (random weights from `seed`; nothing downloaded), in train mode."""
    from .. import models

    builders = {"qwen3": (models.tiny_qwen3, size.qwen3), "llama": (models.tiny_llama, size.llama),
                "qwen3_moe": (models.tiny_qwen3_moe, size.moe)}
    if arch not in builders:
        raise SystemExit(f"unknown model {arch!r}; expected one of {list(ARCHS)}")
    fn, extra = builders[arch]
    kwargs = {**size.common, **extra}
    if arch == "qwen3_moe":
        kwargs.pop("head_dim", None)  # tiny_qwen3_moe takes no head_dim (hidden / heads)
    if arch == "llama" and "head_dim" in kwargs and "head_dim" not in extra:
        kwargs.pop("head_dim")
    model = fn(seed=seed, **kwargs)
    return model.to(device=size.device, dtype=getattr(torch, size.dtype))


def describe_model(arch: str, model: nn.Module) -> str:
    """One line: class, shape (hidden, layers, heads, intermediate, experts, vocabulary) and parameter count."""
    from ..models import param_count

    c = model.config
    moe = f" E{c.num_experts} top{c.num_experts_per_tok} I_moe{c.moe_intermediate_size}" if arch == "qwen3_moe" else ""
    return (f"{type(model).__name__} H{c.hidden_size} L{c.num_hidden_layers} heads {c.num_attention_heads}/"
            f"{c.num_key_value_heads} I{c.intermediate_size}{moe} V{c.vocab_size}, "
            f"{param_count(model) / 1e6:.2f} M params")


def model_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameters and buffers (tied weights once)."""
    ts = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class Workload:
    """One model and one input batch; every variant trains this (or, for torch.compile, a copy made first)."""

    name: str  # "small/qwen3"
    arch: str
    size_name: str
    size: Size
    model: nn.Module
    pristine: nn.Module  # an untouched deep copy (on CPU memory or the device), for variants that need their own
    ids: torch.Tensor  # [batch, seq] int64
    description: str

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.model.model.layers)

    def loss(self, model: Callable[..., Any] | None = None) -> torch.Tensor:
        return (self.model if model is None else model)(input_ids=self.ids, labels=self.ids).loss
