"""Trainer integrations: tapesac inside training loops that split a step across hooks.

- ``tapesac.integrations.hf.TapeSACCallback``: a Hugging Face ``transformers.TrainerCallback``.
- ``tapesac.integrations.lightning.TapeSACCallback``: a Lightning ``Callback`` (``lightning`` or
  ``pytorch_lightning``).

Each module imports only its own framework, so either works without the other installed; importing this package
imports neither (the names below load on first use). Both run one tapesac step per forward+backward — per
micro-batch under gradient accumulation — through the step-free mode (``sac.attach()``, attach.py): the step starts
at the first block forward and ends after the backward, so a step is never abandoned, whatever the accumulation.
Both log the step statistics (``step_metrics``) through the trainer's own logger.
"""

from __future__ import annotations

from typing import Any

from .metrics import step_metrics

__all__ = ["HFCallback", "LightningCallback", "step_metrics"]


def __getattr__(name: str) -> Any:
    if name == "HFCallback":
        from .hf import TapeSACCallback

        return TapeSACCallback
    if name == "LightningCallback":
        from .lightning import TapeSACCallback

        return TapeSACCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
