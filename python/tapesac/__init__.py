"""tapesac: automatic, exact selective activation checkpointing for PyTorch training.

A C++ runtime records each block's forward at the dispatcher into a tape; during backward it replays only the
producers of the tensors autograd consumes. See README.md for the guide and DESIGN.md for the architecture.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from .errors import CaptureError, ConfigError, MemoryLimitError, ReplayContractError, TapeSACError


def _check_saved_hooks_env() -> None:
    # TAPESAC_SAVED_HOOKS picks how autograd hands tapesac its saved tensors (README, How it works, step 1); the
    # extension reads it when loaded, so a misspelt value is refused before that.
    import os

    value = os.environ.get("TAPESAC_SAVED_HOOKS", "")
    if value.lower() not in ("", "cpp", "python"):
        raise ConfigError(f"TAPESAC_SAVED_HOOKS={value!r}: expected 'cpp' (the default: C++ saved-tensor hooks) or "
                          "'python' (autograd's Python saved-tensor hooks, e.g. for compiled autograd); unset it or "
                          "set one of those")


_check_saved_hooks_env()
from . import _C  # noqa: E402
from .higher_order import let_higher_order_ops_through as _let_higher_order_ops_through  # noqa: E402

_let_higher_order_ops_through()
from .config import Approx, Config
from .core import TapeSAC, record_ops
from .stats import BlockStats, StepStats
from .memory import MemoryMeter, MemoryStats, parse_memory_limit
from .report import StepReport
from .validate import ValidationReport, validate

__version__ = "0.1.0"

__all__ = [
    "TapeSAC",
    "Approx",
    "Config",
    "StepStats",
    "BlockStats",
    "StepReport",
    "MemoryMeter",
    "MemoryStats",
    "parse_memory_limit",
    "record_ops",
    "validate",
    "ValidationReport",
    "TapeSACError",
    "ConfigError",
    "MemoryLimitError",
    "ReplayContractError",
    "CaptureError",
]
