"""Progress of the long commands (bench, frontier, validate) on stderr, through tqdm.

``Progress(label)`` is one status line ``[label elapsed] what runs now``: on a terminal a tqdm bar rewritten in place
(cleared by ``done()``, made again on the next call); elsewhere (CI logs, pipes) a line through ``tqdm.write`` at most
every ``every`` seconds, or at once with ``force=True``. ``enabled=False`` prints nothing. stdout (tables, reports)
is never touched.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """One status line on stderr (see the module's contract)."""

    def __init__(self, enabled: bool = True, every: float = 10.0, label: str = "bench") -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.every = every
        self.label = label
        self.last = 0.0
        self.t0 = time.perf_counter()
        self._bar: Any = None

    def __call__(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            if self._bar is None:
                self._bar = tqdm(total=None, file=sys.stderr, leave=False, dynamic_ncols=True,
                                 bar_format=f"[{self.label} {{elapsed}}] {{desc}}")
            self._bar.set_description_str(text)
            return
        now = time.perf_counter()
        if force or now - self.last >= self.every:
            tqdm.write(f"[{self.label} {now - self.t0:6.0f}s] {text}", file=sys.stderr)
            self.last = now

    def done(self) -> None:
        """Clears the status line (a terminal's); the next call starts a new one."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
