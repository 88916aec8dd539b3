"""What ``sac.step()`` returns: the context manager of one step, entered once."""

from __future__ import annotations

from typing import Any

from .errors import TapeSACError

__all__ = ["StepContext"]


class StepContext:
    """What ``sac.step()`` returns: the step's context manager, entered once. Entering it again used to fail inside
    contextlib with an AttributeError ('_GeneratorContextManager' object has no attribute 'args')."""

    __slots__ = ("_cm", "_entered")

    def __init__(self, cm: Any) -> None:
        self._cm = cm
        self._entered = False

    def __enter__(self) -> Any:
        if self._entered:
            raise TapeSACError(
                "this sac.step() context was already entered: sac.step() makes the context of one step. Call it for "
                "every step — `with sac.step():` inside the training loop — rather than once outside it.")
        self._entered = True
        return self._cm.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._cm.__exit__(*exc)
