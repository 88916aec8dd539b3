"""Python higher-order operators (torch.cond, torch.func's custom_function_call, flex_attention, ...) and the
dispatch hook's key.

Note [Higher-order operators pass the hook's key]. A higher-order operator dispatches in Python on the highest key
of its arguments' and the thread's key sets, and has kernels only for the keys it knows. While a block records, the
thread's set includes the dispatch hook's key (Note [Dispatch hook], capture/dispatch_hook.h), the highest one, so
`torch.cond` or `torch.func.vmap` over an `autograd.Function` inside a block raised torch's untyped "could not find
kernel ... at dispatch key DispatchKey.???" where plain PyTorch ran them (a helper's finding; the at::RecordFunction
hook was not affected). The key is a fallthrough for every higher-order operator, those defined before tapesac was
imported and those defined after (torch's default fallthrough list): the operator goes on to its next key, and the
aten calls it makes are recorded as any others.
"""

from __future__ import annotations

import torch

from . import _C


def let_higher_order_ops_through() -> None:
    """Makes the dispatch hook's key a fallthrough for every Python higher-order operator (idempotent)."""
    try:
        import torch._ops as ops

        key = torch._C.DispatchKey(_C.dispatch_hook_key())
        defaults = ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS
        registry = ops._higher_order_ops
    except (AttributeError, ImportError, TypeError, ValueError):  # torch moved these private names: nothing to do
        return
    if key not in defaults:
        defaults.append(key)
    for op in list(registry.values()):
        op.fallthrough(key)
