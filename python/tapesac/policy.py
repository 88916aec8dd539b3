"""Policies as the C++ session takes them: ``parse_policy`` turns a TapeSAC ``policy`` (a name, a set of op names, a
callable) into (label, session policy, save_op), and ``OpSetPolicy`` matches op names for an op-set policy.

Op names are those autograd sees (``tapesac.record_ops`` lists a block's): ``"aten::mm"`` matches every overload,
``"aten::add.Tensor"`` one; ``torch.ops.aten.mm`` (a packet) and ``torch.ops.aten.mm.default`` work too.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from .errors import ConfigError

__all__ = ["POLICIES", "CallablePolicy", "OpSetPolicy", "parse_policy"]

POLICIES = ("none", "full", "auto")


def _op_name(op: Any) -> tuple[str, bool]:
    """(canonical name, is_packet) of a policy entry: OpOverload, OpOverloadPacket or string."""
    if isinstance(op, torch._ops.OpOverload):
        schema = op._schema
        return (schema.name + (f".{schema.overload_name}" if schema.overload_name else "")), False
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name.replace(".", "::", 1) if "::" not in op._qualified_op_name else op._qualified_op_name, True
    if isinstance(op, str):
        if "::" in op:
            base, _, overload = op.partition(".")
            if not overload:
                return base, True
            return (base if overload == "default" else f"{base}.{overload}"), False
        parts = op.split(".")
        if len(parts) == 2:
            return f"{parts[0]}::{parts[1]}", True
        if len(parts) == 3:
            base = f"{parts[0]}::{parts[1]}"
            return (base if parts[2] == "default" else f"{base}.{parts[2]}"), False
    raise ConfigError(
        f"policy entries must be op names like 'aten::mm', 'aten::add.Tensor', 'aten.mm.default' or torch.ops "
        f"objects like torch.ops.aten.mm; got {op!r}"
    )


class OpSetPolicy:
    """Save the outputs of the listed ops; packets match every overload. Remembers which entries matched."""

    def __init__(self, ops: Iterable[Any]):
        self.exact: dict[str, Any] = {}
        self.packets: dict[str, Any] = {}
        for op in ops:
            name, packet = _op_name(op)
            (self.packets if packet else self.exact)[name] = op
        self.matched: set[str] = set()

    def __call__(self, op_name: str) -> bool:
        if op_name in self.exact:
            self.matched.add(op_name)
            return True
        base = op_name.split(".", 1)[0]
        if base in self.packets:
            self.matched.add(base)
            return True
        return False

    def unmatched(self) -> list[Any]:
        return [op for name, op in {**self.exact, **self.packets}.items() if name not in self.matched]


class CallablePolicy:
    """A user's callable op_name -> bool as save_op. The session keeps everything of a block whose decision raised
    (decide.cpp); this remembers the first exception, which the step then raises as a ConfigError chaining it."""

    def __init__(self, fn: Callable[[str], Any]):
        self.fn = fn
        self.error: tuple[str, BaseException] | None = None

    def __call__(self, op_name: str) -> bool:
        try:
            return bool(self.fn(op_name))
        except Exception as e:
            if self.error is None:
                self.error = (op_name, e)
            raise

    def take_error(self) -> tuple[str, BaseException] | None:
        """(op name, exception) of the first call that raised since the last take_error(), else None."""
        error, self.error = self.error, None
        return error


def parse_policy(policy: Any) -> tuple[str, str, Callable[[str], bool] | None]:
    """(label, session policy, save_op) of a TapeSAC policy other than None: the label is what StepStats.policy says
    ("none", "full", "auto", "save_ops" or "callable"), the session policy what _C.Session takes ("plan" for auto)."""
    if isinstance(policy, str):
        if policy == "auto":
            return "auto", "plan", None
        if policy in POLICIES:
            return policy, policy, None
        raise ConfigError(
            f"unknown policy {policy!r}; expected one of {list(POLICIES)}, a set of op names to keep "
            f"(e.g. {{'aten::mm'}}), or a callable op_name -> bool"
        )
    if isinstance(policy, (set, frozenset, list, tuple)):
        return "save_ops", "save_ops", OpSetPolicy(policy)
    if callable(policy):
        return "callable", "save_ops", CallablePolicy(policy)
    raise ConfigError(
        f"policy must be one of {list(POLICIES)}, a set of op names, or a callable op_name -> bool; "
        f"got {type(policy).__name__}"
    )


def held_weakly(save_op: Any) -> Any:
    """What the C++ session calls for `save_op`: a function holding it weakly (the TapeSAC holds it). Python's
    collector cannot see references held in C++, so a policy that refers back to its TapeSAC — a trainer's own method,
    `policy=self.keep_op` — made a cycle through the session that was never collected, closed or not (an adversarial
    test: trainer, model, optimizer state and the counting allocator kept for the process's life)."""
    if save_op is None:
        return None
    ref = weakref.ref(save_op)

    def save(op_name: str) -> bool:
        fn = ref()
        return False if fn is None else fn(op_name)  # the TapeSAC is going: nothing is decided any more

    return save
