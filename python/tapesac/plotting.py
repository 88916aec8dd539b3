"""matplotlib for the plots (StepReport.plot, Frontier.plot, the benchmark's figures): an optional dependency, the
``plot`` extra (``pip install 'tapesac[plot]'``). ``pyplot(what)`` imports it with the Agg backend on first use, and
raises ConfigError naming the extra when it is missing; nothing imports matplotlib at import time. ``save_figure``
writes a figure and always closes it; ``write_output`` writes a text file; both turn a path that cannot be written
(a missing folder, a folder, an image format matplotlib does not know) into ConfigError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["pyplot", "save_figure", "write_output"]


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


def _cannot_write(what: str, path: Path, e: Exception) -> ConfigError:
    return ConfigError(f"{what} cannot write {str(path)!r}: {e}. Give a path in an existing folder (and, for a figure, "
                       f"a format matplotlib writes: .png, .pdf, .svg)")


def save_figure(plt: Any, fig: Any, path: str | Path, what: str, dpi: int = 100) -> Path:
    """Saves `fig` to `path` and closes it, also when saving fails (ConfigError naming the path)."""
    out = Path(path)
    try:
        fig.savefig(out, dpi=dpi)
    except (OSError, ValueError) as e:
        raise _cannot_write(what, out, e) from e
    finally:
        plt.close(fig)
    return out


def write_output(path: str | Path, text: str, what: str) -> Path:
    """Writes `text` to `path` (ConfigError naming the path when it cannot be written)."""
    out = Path(path)
    try:
        out.write_text(text)
    except OSError as e:
        raise _cannot_write(what, out, e) from e
    return out
