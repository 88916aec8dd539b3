"""The ``tapesac`` logger: every warning and info line of the library goes through ``logging.getLogger("tapesac")``.

Contract: nothing is configured at import (no handler, no level, no environment read), so the application's logging
configuration decides where the lines go (``logging.getLogger("tapesac").setLevel(logging.ERROR)`` silences the
warnings; a handler on it or on the root logger routes them to a file, TensorBoard's text log, ...). Without any
configuration Python's last-resort handler prints WARNING and above to stderr: a warning is never silent. Messages
start with ``"tapesac: "`` so that such a bare line says where it came from. Command-line output (tables, reports)
is not logged: the CLI prints it.

``Once`` logs each of its warnings only the first time its key is seen (per object): conflicts and per-block
problems are reported once, not every step. Its records carry the kind of warning as ``record.tapesac_key``
(conflicts.py: "hf", "hooks", "inside-backward", "compiled-blocks", "compiled-model", "no-block", "opaque", "second",
"outside"; core.py: "capture"), for a ``logging.Filter`` that drops a kind a program expects.
"""

from __future__ import annotations

import logging
from typing import Hashable

__all__ = ["logger", "Once"]

logger = logging.getLogger("tapesac")


class Once:
    """Warnings of one object (a TapeSAC), each logged the first time its key is seen."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()

    def warning(self, key: Hashable, message: str) -> bool:
        """Logs `message` as a warning unless `key` was seen before; True when it was logged."""
        if key in self._seen:
            return False
        self._seen.add(key)
        logger.warning(message, extra={"tapesac_key": key[0] if isinstance(key, tuple) else key})
        return True

    def seen(self, key: Hashable) -> bool:
        return key in self._seen
