"""The C++ session of a TapeSAC, made from its Config: the replay arena's memory pool on CUDA, the graph device of the
replay backend, the preservation mode the contract allows, and approximate rematerialization."""

from __future__ import annotations

from typing import Any

import torch

from . import _C
from .config import Config
from .policy import held_weakly

__all__ = ["make_session"]


def make_session(cfg: Config, policy: str, save_op: Any, limit: int, device: torch.device, backend: str,
                 device_timing: bool) -> tuple[Any, Any]:
    """The C++ session of a TapeSAC, and its replay arena's memory pool (CUDA; else None)."""
    check = cfg.contract != "off"
    arena_pool, arena = None, None
    if device.type == "cuda":
        # One private pool for every replay of this instance: the replay arena (allocator/limit.h).
        arena_pool = torch.cuda.MemPool()
        arena = tuple(int(i) for i in arena_pool.id)
    graph_device = None
    if backend == "cuda_graph":
        # Graphs are captured into the replay arena: their static memory is part of it.
        graph_device = _C.cuda_graph_device(device.index or 0, arena, map_nodes=cfg.graph_timing != "off")
    elif backend == "emulated_graph":
        graph_device = _C.emulated_graph_device()
    preserve = "off" if cfg.preserve == "off" or not check else "snapshots" if cfg.preserve == "snapshots" else "regions"
    session = _C.Session(policy, held_weakly(save_op), check, check, cfg.contract == "strict", memory_limit=limit,
                         arena_pool=arena, graph_device=graph_device,
                         arena_device=(device.index or 0) if device.type == "cuda" else 0, preserve=preserve,
                         # Device op times (CUPTI, else CUDA events) where the planner uses op costs.
                         device_timing=device_timing, graph_timing=cfg.graph_timing)
    if cfg.approx is not None:
        a = cfg.approx
        session.set_approx(float(a.fraction), a.method, mlp="mlp" in a.targets, attn="attn" in a.targets, seed=a.seed)
    return session, arena_pool
