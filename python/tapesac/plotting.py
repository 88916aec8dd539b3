"""matplotlib for the plots (StepReport.plot, Frontier.plot, the benchmark's figures): an optional dependency, the
``plot`` extra (``pip install 'tapesac[plot]'``). ``pyplot(what)`` imports it with the Agg backend on first use, and
raises ConfigError naming the extra when it is missing; nothing imports matplotlib at import time.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

__all__ = ["pyplot"]


def pyplot(what: str) -> Any:
    """matplotlib.pyplot (Agg backend), for `what` (e.g. "StepReport.plot") to name in the error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(f"{what} needs matplotlib, which is not installed: pip install 'tapesac[plot]' (or pip "
                          f"install matplotlib)") from e
    return plt
