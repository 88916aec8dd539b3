"""What ``sac.step()`` returns: the context manager of one step, entered once."""

from __future__ import annotations

import threading
from typing import Any

from .errors import TapeSACError

__all__ = ["StepContext"]


class StepContext:
    """What ``sac.step()`` returns: the step's context manager, entered once. Entering it again used to fail inside
    contextlib with an AttributeError ('_GeneratorContextManager' object has no attribute 'args')."""

    __slots__ = ("_cm", "_entered", "_thread")

    def __init__(self, cm: Any) -> None:
        self._cm = cm
        self._entered = False
        self._thread: int | None = None

    def __enter__(self) -> Any:
        if self._entered:
            raise TapeSACError(
                "this sac.step() context was already entered: sac.step() makes the context of one step. Call it for "
                "every step — `with sac.step():` inside the training loop — rather than once outside it.")
        self._entered = True
        self._thread = threading.get_ident()
        return self._cm.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        # The step's hooks, its recorder and its memory counter are the entering thread's (thread-local state in C++):
        # ending it from another thread reset that thread's state instead and left the entering thread's counter
        # dangling — the next allocation there crashed (found by an adversarial test). The step stays open for its
        # own thread to exit.
        if self._thread is not None and threading.get_ident() != self._thread:
            raise TapeSACError(
                "sac.step() was exited on another thread than the one that entered it; a step's hooks and memory "
                "counter belong to its thread. Exit it on that thread (a `with sac.step():` block does), or use "
                "sac.attach(optimizer) when the step's end comes from elsewhere.")
        return self._cm.__exit__(*exc)
