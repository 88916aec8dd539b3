"""Typed errors of tapesac.

Every message says what was expected, what was found, and how to fix it. The C++ runtime raises these same
classes (its exceptions are translated by ``tapesac._C``).
"""

__all__ = ["TapeSACError", "ConfigError", "MemoryLimitError", "ReplayContractError", "CaptureError"]


class TapeSACError(RuntimeError):
    """Base class of every tapesac error (a misuse of the step protocol raises this class itself)."""


class ConfigError(TapeSACError, ValueError):
    """A configuration value is invalid: the message lists the accepted values."""


class MemoryLimitError(TapeSACError):
    """The memory limit cannot be met."""


class ReplayContractError(TapeSACError):
    """Replay would not see what the forward saw (a tensor it needs changed), or its result diverged."""


class CaptureError(TapeSACError):
    """Recording a block's forward failed."""
