"""Where tapesac applies: the blocks of a model (``resolve_blocks``), the model's device, and the replay backend.

``blocks`` may be an nn.ModuleList, a list of modules, a module class, a class name, or a dotted path with ``*``
(``"model.layers.*"``); nested matches are merged into the outermost block.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import _C
from .errors import ConfigError

__all__ = ["resolve_blocks", "check_blocks", "resolve_backend", "model_device", "is_compiled", "ModelTensors"]


def is_compiled(module: nn.Module) -> bool:
    """True for torch.compile(module) (an OptimizedModule) and module.compile() (compiled in place)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model without any)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


class ModelTensors:
    """The parameters and buffers of a model, read at every step's start (the step's baseline and which storages are
    parameters: replay/session.h), without walking the module tree each time.

    Note [Module tree cache]. ``model.parameters()`` walks the tree through nested generators: 59 us per step on
    one Qwen3 decoder layer (22 modules), ~1 ms on 28 layers, paid by every step (issue 20: a one-layer step's fixed
    cost was 96 us). The module list is cached and checked each step instead: every cached module's children,
    compared by identity (a submodule assigned, deleted or replaced through ``_modules`` rebuilds the list), and the
    tensors are read from each module's ``_parameters`` and ``_buffers`` as they are at that moment (a parameter or
    buffer reassigned between steps, FSDP2 swapping them through ``_parameters``, is seen). Shared modules appear
    once (``modules()``); a tensor shared by two modules twice (the session counts each storage once).
    """

    def __init__(self, model: nn.Module, on_tree_change: Callable[[], None] | None = None) -> None:
        self._model = model
        self._modules: list[nn.Module] = []
        self._children: list[tuple[Any, ...]] = []
        self._on_tree_change = on_tree_change  # called when the tree changed since the last step (not the first)

    def _tree_changed(self) -> bool:
        if not self._modules:
            return True
        for m, children in zip(self._modules, self._children):
            if tuple(m._modules.values()) != children:
                return True
        return False

    def __call__(self) -> list[torch.Tensor]:
        if self._tree_changed():
            if self._modules and self._on_tree_change is not None:
                self._on_tree_change()  # may raise: the cache is rebuilt at the next call
            self._modules = list(self._model.modules())
            self._children = [tuple(m._modules.values()) for m in self._modules]
        out: list[torch.Tensor] = []
        for m in self._modules:
            for t in m._parameters.values():
                if t is not None:
                    out.append(t)
            for t in m._buffers.values():
                if t is not None:
                    out.append(t)
        return out


def resolve_backend(backend: str, device: torch.device) -> str:
    """The replay backend for `backend` (validated) on `device` (see the docstring of TapeSAC)."""
    has_graphs = _C.has_cuda_backend
    if backend == "cuda_graph":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(
                f"backend='cuda_graph' needs a CUDA device: the model is on {device} (torch.cuda.is_available() = "
                f"{torch.cuda.is_available()}); use backend='eager', or 'auto', which picks eager there")
        if not has_graphs:
            raise ConfigError("backend='cuda_graph' needs tapesac built with its GPU backend (this build has none); "
                              "rebuild where nvcc and a CUDA torch are present, or use backend='eager'")
        return "cuda_graph"
    if backend == "auto":
        return "cuda_graph" if device.type == "cuda" and has_graphs and torch.cuda.is_available() else "eager"
    return backend


def resolve_blocks(model: nn.Module, blocks: Any) -> list[tuple[str, nn.Module]]:
    named = list(model.named_modules())
    by_id = {id(m): n for n, m in named}

    def from_modules(mods: Iterable[Any], what: str) -> list[tuple[str, nn.Module]]:
        out = []
        for m in mods:
            if not isinstance(m, nn.Module):
                raise ConfigError(f"blocks={what} must contain nn.Module objects, found {type(m).__name__}")
            if id(m) not in by_id:
                raise ConfigError(
                    f"blocks={what} contains a {type(m).__name__} that is not a submodule of the model; pass "
                    f"modules of this model (e.g. model.model.layers)"
                )
            out.append((by_id[id(m)], m))
        return out

    if isinstance(blocks, nn.ModuleList):
        chosen = from_modules(blocks, "ModuleList")
    elif isinstance(blocks, (list, tuple)):
        chosen = from_modules(blocks, "list")
    elif isinstance(blocks, type) and issubclass(blocks, nn.Module):
        chosen = [(n, m) for n, m in named if isinstance(m, blocks) and m is not model]
    elif isinstance(blocks, str):
        if "." in blocks or "*" in blocks:
            pat = blocks.split(".")
            chosen = [
                (n, m)
                for n, m in named
                if n and len(n.split(".")) == len(pat) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), pat))
            ]
        else:
            chosen = [(n, m) for n, m in named if type(m).__name__ == blocks and m is not model]
            if not chosen:
                chosen = [(n, m) for n, m in named if n == blocks]
    elif isinstance(blocks, nn.Module):
        chosen = from_modules([blocks], "module")
    else:
        raise ConfigError(
            "blocks must be an nn.ModuleList, a list of modules, a module class, a class name or a dotted path "
            f"with * (e.g. 'model.layers.*'); got {type(blocks).__name__}"
        )
    # Outermost matches only: a block inside another block is recorded as part of the outer one.
    # By name (each ancestor looked up once): scanning every named module per block was quadratic, 1.7 s to construct
    # a TapeSAC over 1,600 blocks (an adversarial test).
    chosen_ids = {id(m) for _, m in chosen}
    by_name = dict(named)
    outer = []
    for name, m in chosen:
        parts = name.split(".")
        ancestors = (by_name.get(".".join(parts[:i])) for i in range(len(parts)))
        if any(a is not None and a is not m and id(a) in chosen_ids for a in ancestors):
            continue
        outer.append((name, m))
    containers = [n for n, m in outer if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    if containers:  # no forward of their own: such a "block" is never called, nothing would be checkpointed
        raise ConfigError(
            f"blocks={blocks!r} selects {containers[0]!r}, a {type(dict(outer)[containers[0]]).__name__}: a container "
            f"the forward never calls, so nothing would be checkpointed. Select its layers: "
            f"blocks={containers[0] + '.*'!r}")
    scripted = [n for n, m in outer if isinstance(m, torch.jit.ScriptModule)]
    if scripted:  # torch refuses forward hooks on them (every step raised its untyped RuntimeError)
        raise ConfigError(
            f"blocks={blocks!r} selects {scripted[0]!r}, a TorchScript module (torch.jit.script / trace): torch "
            f"supports no forward hooks on those, and tapesac opens and closes each block call through them. List the "
            f"unscripted module as the block (script submodules inside it if you need to), or leave it out of blocks=")
    if not outer:
        classes = sorted({type(m).__name__ for _, m in named})[:12]
        paths = [n for n, _ in named if n][:12]
        raise ConfigError(
            f"blocks={blocks!r} matches no submodule of {type(model).__name__}. Expected a dotted path such as "
            f"{paths[:4]} (with * for any index, e.g. 'model.layers.*'), or a class name such as {classes[:6]}"
        )
    return outer


def check_blocks(model: nn.Module, spec: Any, blocks: list[tuple[str, nn.Module]]) -> None:
    """TapeSACError unless `spec` still selects the modules `blocks` holds (called when the module tree changed between
    steps). The hooks are on those modules: a block replaced (``model.layers[0] = ...``, ``torch.compile`` of a layer
    assigned back), added or removed afterwards would run without tapesac, in silence (an adversarial test)."""
    from .errors import TapeSACError

    try:
        now = resolve_blocks(model, spec)
    except ConfigError:
        now = []
    if [m for _, m in now] == [m for _, m in blocks]:
        return
    was = {id(m): n for n, m in blocks}
    new = {id(m): n for n, m in now}
    gone = [n for n, m in blocks if id(m) not in new]
    added = [f"{n} ({type(m).__name__})" for n, m in now if id(m) not in was]
    what = "; ".join(p for p in (f"no longer blocks: {gone}" if gone else "",
                                 f"new blocks: {added}" if added else "") if p) or "reordered"
    raise TapeSACError(f"the model's blocks changed after this TapeSAC was made ({what}): tapesac's hooks are on the "
                       f"modules it found then, so a changed block would run without it. Make the TapeSAC after "
                       f"changing the model: sac.close(), then tapesac.TapeSAC(model, ...)")
