"""LoRA adapters (the `peft` library) inside the recorded layers: the frozen base weights, the adapters' low-rank
products and their dropout are recorded and replayed like any other op. Reference checks (`conftest.reference_check`:
loss, every gradient — only the adapters train — and the parameters after each SGD step bitwise equal to no
checkpointing) on HF Qwen3 with adapters on q/v/up/down projections, with and without LoRA dropout, under `full` on
both CPU backends and under `auto` at a limit 30% of the way from `full`'s peak to `none`'s."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import models as M
from conftest import limit_between_full_and_none, reference_check

peft = pytest.importorskip("peft", reason="peft is installed by `make setup`; pip install peft")
pytestmark = pytest.mark.usefixtures("one_thread")


def lora_qwen3(dropout: float) -> nn.Module:
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                          target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(M.hf_qwen3(3), cfg)


def layers(model: nn.Module) -> nn.ModuleList:
    return model.base_model.model.model.layers


def ids() -> torch.Tensor:
    return torch.randint(3, 100, (2, 24))  # [batch, seq]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("backend", ["eager", "emulated_graph"])
def test_lora_full(dropout: float, backend: str) -> None:
    res = reference_check(lambda: lora_qwen3(dropout), ids, "full", layers, M.hf_loss, steps=3, optimizer=sgd,
                          block_calls=3, sac_kwargs={"backend": backend})
    frozen = [n for n, p in res.model.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in res.model.parameters() if not p.requires_grad), (
        "the base weights must stay frozen (no gradient) under tapesac as without it")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_auto(dropout: float) -> None:
    limit = limit_between_full_and_none(lambda: lora_qwen3(dropout), layers, M.hf_loss, ids, 0.3)
    res = reference_check(lambda: lora_qwen3(dropout), ids, "auto", layers, M.hf_loss, steps=3, optimizer=sgd,
                          block_calls=3, sac_kwargs={"memory_limit": limit})
    assert all(s.dropped_tensors < s.saved_tensors for s in res.all_stats[1:]), "a planned step kept nothing"
