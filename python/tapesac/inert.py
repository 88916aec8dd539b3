"""Hooks that a copy of the model does not inherit: ``copy.deepcopy(model)`` and ``pickle`` copy a module's hook
dictionaries, so a step hook or an attach hook copied as it is would act on the original TapeSAC from the copy's
forward (open a block call in its session, push its saved-tensor hooks, start one of its steps) and cannot be pickled
(a closure). Wrapped in ``CopiesInert``, the copy gets an ``Inert`` hook in its place, as the conflict checks' watch
hooks already did (conflicts._Hook)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["CopiesInert", "Inert"]


class Inert:
    """What a copied or pickled model holds in place of a tapesac hook: nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class CopiesInert:
    """Calls `fn`; a deep copy or a pickle of it is an Inert."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (Inert, ())
