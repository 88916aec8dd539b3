"""The hooks of one step: a forward pre-hook and post-hook on every block, installed by ``sac.step()`` and removed
in its ``finally``. The pre-hook opens a block call in the C++ session and enters the saved-tensor hooks whose
pack/unpack are C++ functions; the post-hook closes them. Blocks nested in an open block record into it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["StepHooks"]


class StepHooks:
    """Block hooks of one TapeSAC; `install()` for a step, `remove()` after it (idempotent, also after errors)."""

    def __init__(self, session: Any, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        self._session = session
        self._blocks = list(blocks)
        self._handles: list[Any] = []
        self._open: list[tuple[nn.Module, Any]] = []

    def install(self) -> None:
        for name, module in self._blocks:
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(module), always_call=True))

    def remove(self) -> None:
        """Removes the hooks and closes every open block call (also if closing one raises)."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        self.close_open_blocks()

    def open_block(self, name: str, module: nn.Module) -> None:
        """Opens `module`'s block call now, for a step that starts inside that block's forward pre-hooks
        (sac.attach): torch gathered the call's pre-hooks before install() added this block's."""
        self._pre_hook(name)(module, (), {})

    def close_open_blocks(self) -> None:
        while self._open:
            self._close_top_block()
        self._session.end_block()

    def _pre_hook(self, name: str) -> Callable[..., None]:
        session = self._session

        def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled() or session.block_open:
                return None
            if session.begin_block(name):
                hooks = torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack)
                hooks.__enter__()
                self._open.append((module, hooks))
            return None

        return pre_hook

    def _post_hook(self, module: nn.Module) -> Callable[..., None]:
        def post_hook(mod: nn.Module, args: Any, output: Any) -> None:
            if self._open and self._open[-1][0] is module:
                self._close_top_block()
            return None

        return post_hook

    def _close_top_block(self) -> None:
        """Pops the innermost open block's saved-tensor hooks and closes its block call (also if popping raises)."""
        _, hooks = self._open.pop()
        try:
            hooks.__exit__(None, None, None)
        finally:
            self._session.end_block()
