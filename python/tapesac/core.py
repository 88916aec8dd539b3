"""The TapeSAC front: configuration, block selection, the per-step hooks, and step statistics.

Contract: ``TapeSAC(model, ...)`` never edits the model (its code, attributes or ``state_dict`` keys). Hooks exist
only inside ``with sac.step():`` and are removed in ``finally`` — also when the step raised. Everything that runs
per op or per saved tensor is C++ (``tapesac._C``); this module runs per block call and per step.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import json
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from . import _C
from .errors import ConfigError, MemoryLimitError, TapeSACError
from . import preserve as _preserve
from .memory import MemoryStats, parse_memory_limit
from .preserve import PRESERVE_MODES
from .stats import SCHEMA_VERSION, BlockStats, StepStats, block_stats_from, step_stats_from

__all__ = ["TapeSAC", "Approx", "StepStats", "BlockStats", "record_ops"]

POLICIES = ("none", "full", "auto")
BACKENDS = ("auto", "eager", "cuda_graph", "emulated_graph")
CONTRACTS = ("check", "strict", "off")
GRAPH_TIMINGS = ("first", "every", "off")
MAX_PRESERVE_CHOICES = 1024
HISTORY_STEPS = 1000
RECALIBRATIONS = 1

_thread_state = threading.local()


APPROX_METHODS = ("sketch", "greedy")
APPROX_TARGETS = ("mlp", "attn")


@dataclass(frozen=True, kw_only=True)
class Approx:
    """Approximate rematerialization of linear layers: replay recomputes only a fraction of the units (MLP hidden units,
    attention heads) of each matched component (README, "Approximate rematerialization"). The forward and the loss
    are exact; gradients are estimates.

    fraction: share of the units recomputed, in (0, 1] (per component round(fraction * units), at least 1). 1 is
        exact (bitwise equal to exact replay).
    method: "sketch" samples units with probabilities proportional to importance and reweights them by 1/p (an
        unbiased gradient estimate); "greedy" recomputes the most important units (biased, lower variance).
    targets: the components approximated: "mlp" — gated MLPs, per hidden unit (SwiGLU/GeGLU: HF Llama, Qwen3, ...);
        "attn" — attention, per query head (q/k/v projections and the CPU flash SDPA kernel; grouped-query attention
        included). Values after an approximated attention that replay would rebuild from its output (the residual
        stream, saved by the next norm) are kept instead. Other patterns are replayed exactly.
    seed: seed of the sketch's sampling (a private generator; torch's generators are never touched). Each step and
        each block call draws independently.
    """

    fraction: float = 2 / 3
    method: str = "sketch"
    targets: tuple[str, ...] = ("mlp", "attn")
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not (
            0 < self.fraction <= 1
        ):
            raise ConfigError(f"Approx(fraction={self.fraction!r}): expected a number in (0, 1], e.g. 2/3")
        if self.method not in APPROX_METHODS:
            raise ConfigError(f"Approx(method={self.method!r}): expected one of {list(APPROX_METHODS)}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (tuple, list)) or not targets or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"Approx(targets={self.targets!r}): expected a non-empty tuple of {list(APPROX_TARGETS)}")
        for t in targets:
            if t not in APPROX_TARGETS:
                raise ConfigError(f"Approx(targets={self.targets!r}): unknown target {t!r}; expected {list(APPROX_TARGETS)}")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(targets)))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ConfigError(f"Approx(seed={self.seed!r}): expected an int in [0, 2**64)")


def record_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """Runs ``fn(*args, **kwargs)`` once with the C++ recorder active and returns the ops it recorded.

    The names are those autograd sees (composite ops decomposed): ``"ns::name"`` for a default overload,
    ``"ns::name.overload"`` otherwise — the same as ``func._schema`` in a ``TorchDispatchMode``.
    """
    if not callable(fn):
        raise ConfigError(f"record_ops expects a callable (a function or an nn.Module), got {type(fn).__name__}")
    return list(_C.record_ops(fn, *args, **kwargs))


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


class _OpSetPolicy:
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


def _is_compiled(module: nn.Module) -> bool:
    """True for torch.compile(module) (an OptimizedModule) and module.compile() (compiled in place)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def _model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model without any)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _resolve_backend(backend: str, device: torch.device) -> str:
    """The replay backend for `backend` (validated) on `device` (see the docstring of TapeSAC)."""
    has_graphs = getattr(_C, "has_cuda_backend", False) and hasattr(_C, "cuda_graph_device")
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


def _resolve_blocks(model: nn.Module, blocks: Any) -> list[tuple[str, nn.Module]]:
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
    chosen_ids = {id(m) for _, m in chosen}
    outer = []
    for name, m in chosen:
        parts = name.split(".")
        ancestors = {".".join(parts[:i]) for i in range(len(parts))}
        if any(id(mm) in chosen_ids and nn_name in ancestors for nn_name, mm in named if mm is not m):
            continue
        outer.append((name, m))
    if not outer:
        classes = sorted({type(m).__name__ for _, m in named})[:12]
        paths = [n for n, _ in named if n][:12]
        raise ConfigError(
            f"blocks={blocks!r} matches no submodule of {type(model).__name__}. Expected a dotted path such as "
            f"{paths[:4]} (with * for any index, e.g. 'model.layers.*'), or a class name such as {classes[:6]}"
        )
    return outer


class TapeSAC:
    """Automatic selective activation checkpointing for the blocks of ``model``.

    Args:
        model: the nn.Module trained; not modified.
        blocks: the recorded, checkpointed units: an nn.ModuleList, a list of modules, a module class, a class name,
            or a dotted path with ``*`` (``"model.layers.*"``). Nested matches are merged into the outermost block.
        policy: ``"full"`` (keep only block inputs and opaque tensors; replay the rest on demand), ``"none"`` (keep
            everything; only record and measure), a set of op names whose outputs are kept (``{"aten::mm"}``,
            ``torch.ops.aten.mm``, ``torch.ops.aten.mm.default``), or a callable ``f(op_name) -> bool`` (True keeps;
            called once per distinct op overload), or ``"auto"``: the planner keeps the values whose replay costs
            the most time per byte, so that the predicted step peak stays under ``memory_limit`` (the first step
            runs ``"full"`` while measuring op times and the peak; the plan applies from the second step and is
            redone when a tape changes or a measured peak exceeds the limit). Default: ``"auto"`` with a
            ``memory_limit``, else ``"full"``.
        memory_limit: the step-peak limit: bytes (int), a size (``"20GiB"``, ``"512MB"``) or a percentage of the
            device's memory (``"90%"``; on CPU of physical RAM). Enforced during replay: a replay that would not fit
            runs in pieces, and one that cannot fit raises MemoryLimitError. With a limit, the default policy is
            ``"auto"`` (the planner).
        backend: ``"auto"``, ``"eager"``, ``"cuda_graph"`` or ``"emulated_graph"``. ``"cuda_graph"`` replays each
            block as a pruned CUDA graph (one capture per distinct block, after one eager warm-up replay; a block
            that cannot be captured or launched replays eagerly, and ``StepStats``/``BlockStats`` say why); it
            needs a CUDA model and a build with the GPU backend (ConfigError otherwise). ``"auto"`` picks
            ``"cuda_graph"`` when both are there, else ``"eager"``. ``"emulated_graph"`` runs the same graph replayer
            with an emulated executable graph on any device (for tests; slower than eager). ``backend`` holds the
            choice.
        graph_timing: with a graph backend, which launches are timed per op (``BlockStats.graph_op_ms``):
            ``"first"`` (default) the first launch of each graph, ``"every"`` every launch, ``"off"`` none. On CUDA a
            timed launch is measured by CUPTI (the device time of each op's kernels) and costs one device
            synchronisation; when a profiler holds CUPTI the launch runs untimed and ``graph_timing_note`` says so.
        contract: ``"check"`` (version checks on every tensor replay reads and every saved tensor, metadata checks
            on every replayed output), ``"strict"`` (also a byte checksum of each dropped tensor at forward,
            compared after replay: a mismatch raises ReplayContractError), or ``"off"`` (no checks; unsafe).
        log: a path: one JSON line per step (the step's statistics and memory) is appended to it.
        preserve: how a replay sees a tensor that the step wrote in place after the block's forward read it (a
            memory bank, a queue, a modified input): ``"regions"`` saves the overwritten regions just before each
            write, ``"snapshots"`` copies the whole tensor at its first write, ``"keep"`` keeps the activations whose
            replay reads it (from the second step; the first uses regions), ``"auto"`` (default) chooses per tensor
            from the measured costs of the previous step, ``"off"`` rejects such replays with ReplayContractError.
            Writes must happen on the step's thread; others are detected by version counters and rejected.
        records: a path: one JSON line per replayed value (block, value, op, status match / recovered / rejected /
            divergent, or approximated with ``approx``, bytes, time) is appended to it; ``last_records`` holds the
            last step's.
        approx: a ``tapesac.Approx``: replay recomputes only a fraction of each gated MLP's hidden units and/or each
            attention's heads (greedy, or an unbiased sketch); the loss stays exact, gradients become estimates.
            None (default): exact replay.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        blocks: Any = "model.layers.*",
        policy: Any = None,
        memory_limit: Any = None,
        backend: str = "auto",
        graph_timing: str = "first",
        contract: str = "check",
        approx: Approx | None = None,
        log: Any = None,
        preserve: str = "auto",
        records: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"TapeSAC expects the model as a torch.nn.Module, got {type(model).__name__}")
        self._device = _model_device(model)
        limit = parse_memory_limit(memory_limit, self._device)
        if policy is None:
            policy = "auto" if limit is not None else "full"
        if log is not None and not isinstance(log, (str, os.PathLike)):
            raise ConfigError(f"log must be a file path (str or os.PathLike) for the JSON-lines telemetry, got "
                              f"{type(log).__name__}")
        if backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r} is not supported; expected one of {list(BACKENDS)}")
        self.backend = _resolve_backend(backend, self._device)
        if graph_timing not in GRAPH_TIMINGS:
            raise ConfigError(f"graph_timing={graph_timing!r} is not supported; expected one of {list(GRAPH_TIMINGS)}")
        if contract not in CONTRACTS:
            raise ConfigError(f"contract={contract!r} is not supported; expected one of {list(CONTRACTS)}")
        if preserve not in PRESERVE_MODES:
            raise ConfigError(f"preserve={preserve!r} is not supported; expected one of {list(PRESERVE_MODES)}")
        if records is not None and not isinstance(records, (str, os.PathLike)):
            raise ConfigError(f"records must be a file path (str or os.PathLike) for the JSON-lines execution "
                              f"records, got {type(records).__name__}")
        if approx is not None and not isinstance(approx, Approx):
            raise ConfigError(f"approx must be a tapesac.Approx(fraction=..., method=..., targets=...) or None, got "
                              f"{type(approx).__name__}")
        if approx is not None and contract == "strict":
            raise ConfigError("approx cannot run with contract='strict' (which checks that replay rebuilds every "
                              "dropped tensor byte for byte); use contract='check' with approx")
        self._model = model
        self._blocks = _resolve_blocks(model, blocks)
        compiled = [n for n, m in self._blocks if _is_compiled(m)]
        if compiled:
            warnings.warn(
                f"tapesac: block(s) {compiled[:4]}{'...' if len(compiled) > 4 else ''} are torch.compile'd: a "
                f"compiled forward runs as one opaque graph that tapesac cannot replay, so everything it saves is "
                f"kept (exact, but no memory is saved). Apply tapesac to the uncompiled blocks (compile submodules "
                f"inside them, or other parts of the model) to checkpoint them.",
                stacklevel=2,
            )
        self._policy_label, session_policy, save_op = self._normalize_policy(policy)
        self._save_op = save_op
        check = contract != "off"
        arena = None
        if self._device.type == "cuda":
            # One private pool for every replay of this instance: the replay arena (allocator/limit.h).
            self._arena_pool = torch.cuda.MemPool()
            arena = tuple(int(i) for i in self._arena_pool.id)
        graph_device = None
        if self.backend == "cuda_graph":
            # Graphs are captured into the replay arena: their static memory is part of it.
            graph_device = _C.cuda_graph_device(self._device.index or 0, arena, map_nodes=graph_timing != "off")
        elif self.backend == "emulated_graph":
            graph_device = _C.emulated_graph_device()
        self._session = _C.Session(session_policy, save_op, check, check, contract == "strict",
                                   memory_limit=limit or 0, arena_pool=arena, graph_device=graph_device,
                                   arena_device=(self._device.index or 0) if self._device.type == "cuda" else 0,
                                   preserve="off" if preserve == "off" or not check else
                                   "snapshots" if preserve == "snapshots" else "regions",
                                   # Device op times (CUPTI, else CUDA events) where the planner uses op costs.
                                   device_timing=self._device.type == "cuda" and self._policy_label == "auto",
                                   graph_timing=graph_timing)
        self._preserve = preserve if check else "off"
        self._preserve_choices: dict[int, str] = {}
        self._preserve_trials: list[Any] = []
        self._preserve_trying = "snapshots" if preserve == "snapshots" else "regions"
        self._preserve_mode: str | None = None
        self._records_path = Path(records) if records is not None else None
        self._last_records: list[dict[str, Any]] | None = []
        self._approx = approx
        if approx is not None:
            self._session.set_approx(float(approx.fraction), approx.method, mlp="mlp" in approx.targets,
                                     attn="attn" in approx.targets, seed=approx.seed)
        self._planner = None
        self._limit = limit or 0
        self._session.set_graph_memory_limit(self._limit)
        self._model_error = 0
        self._recalibrations = 0
        self._plan: dict[str, Any] | None = None
        self._plans: list[dict[str, Any]] = []
        if self._policy_label == "auto":
            if limit is None:
                raise ConfigError(
                    "policy='auto' plans under a memory limit: pass memory_limit (bytes, e.g. '20GiB', or '90%' of "
                    "the device's memory), or use policy='full' / 'none' without one"
                )
            self._planner = _C.AutoPlanner(self._session)
        self._log_path = Path(log) if log is not None else None
        for what, path in (("log", self._log_path), ("records", self._records_path)):
            if path is None:
                continue
            try:
                path.open("a").close()
            except OSError as e:
                raise ConfigError(f"{what}={str(path)!r} cannot be opened for appending ({e}); pass a writable file "
                                  f"path")
        self._timeline: dict[str, Any] | None = {}
        self._steps = 0
        self._last: StepStats | None = None
        # The last HISTORY_STEPS steps (a 40,000-step run must not grow host memory step by step).
        self._history: collections.deque[StepStats] = collections.deque(maxlen=HISTORY_STEPS)
        self._closed = False
        self._open: list[tuple[nn.Module, Any]] = []
        self._warned_unmatched = False

    @staticmethod
    def _normalize_policy(policy: Any) -> tuple[str, str, Any]:
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
            matcher = _OpSetPolicy(policy)
            return "save_ops", "save_ops", matcher
        if callable(policy):
            return "callable", "save_ops", lambda name: bool(policy(name))
        raise ConfigError(
            f"policy must be one of {list(POLICIES)}, a set of op names, or a callable op_name -> bool; "
            f"got {type(policy).__name__}"
        )

    # -- properties -------------------------------------------------------------------------------------------
    @property
    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The (qualified name, module) pairs recorded as blocks."""
        return list(self._blocks)

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the most recent finished step (None before the first)."""
        return self._last

    @property
    def history(self) -> list[StepStats]:
        """Statistics of the last ``HISTORY_STEPS`` (1000) steps, oldest first."""
        return list(self._history)

    # -- the step ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator["TapeSAC"]:
        """Context manager around one training step (forward and backward both inside)."""
        if self._closed:
            raise TapeSACError("this TapeSAC was closed; create a new one to train with tapesac again")
        active = getattr(_thread_state, "active", None)
        if active is not None:
            same = "the same" if active is self else "another"
            raise TapeSACError(
                f"sac.step() entered while a step of {same} TapeSAC is open on this thread; steps cannot nest. "
                f"Finish the open `with sac.step():` block first."
            )
        params = [p for p in self._model.parameters()] + [b for b in self._model.buffers()]
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        if self._planner is not None:
            self._planner.begin_step()
            # The measuring step runs "full" without enforcing the limit, so that an infeasible limit is reported by
            # the planner with the smallest feasible one, rather than by the first replay that does not fit.
            self._session.set_memory_limit(0 if self._plan is None else self._limit)
        elif self._limit:
            # preserve="auto" trying its modes: measured without enforcing the limit (like the planner's measuring
            # step), so that a mode over the limit is measured and not chosen rather than failing the step.
            exploring = self._preserve == "auto" and self._preserve_mode is None and bool(self._preserve_choices)
            self._session.set_memory_limit(0 if exploring else self._limit)
        self._session.begin_step(params)
        _thread_state.active = self
        handles = []
        start = time.perf_counter()
        try:
            for name, module in self._blocks:
                handles.append(module.register_forward_pre_hook(self._make_pre_hook(name), with_kwargs=True))
                handles.append(module.register_forward_hook(self._make_post_hook(module), always_call=True))
            yield self
        finally:
            for h in handles:
                h.remove()
            self._close_open_blocks()
            self._session.end_step()
            _thread_state.active = None
            self._steps += 1
            self._last = self._collect(time.perf_counter() - start)
            self._history.append(self._last)
            self._warn_unmatched()
            self._write_log(self._last)
            self._write_records()
        # Only after a step that finished: plan (policy "auto") from what it measured.
        self._replan_if_needed(self._last)
        self._choose_preservation(self._last)

    def _choose_preservation(self, st: StepStats) -> None:
        """preserve="auto"/"keep": after a step, the storages it wrote after a block read them get their mode for the
        next steps. "keep" keeps their dependents. "auto" measures: the steps after the first such write run
        "regions", "snapshots" and "keep" in turn, then the best by tapesac.preserve.pick stays (and applies to
        storages found later). Choices persist: a storage whose dependents are kept is no longer read by replays,
        so it no longer shows up as written."""
        if self._preserve not in ("auto", "keep"):
            return
        written = [int(p["storage"]) for p in st.preserved]
        if self._preserve == "keep":
            mode = "keep"
        elif self._preserve_mode is not None:
            mode = self._preserve_mode
        elif not self._preserve_choices and not written:
            return  # nothing written yet
        else:
            cost = st.replay_ms + sum(p["save_ns"] + p["restore_ns"] for p in st.preserved) / 1e6
            peak = st.memory.peak_bytes if st.memory else 0
            self._preserve_trials.append(_preserve.Trial(self._preserve_trying, peak, cost))
            untried = [m for m in _preserve.EXPLORED if m not in {t.mode for t in self._preserve_trials}]
            if untried:
                mode = self._preserve_trying = untried[0]
            else:
                mode = self._preserve_mode = _preserve.pick(self._preserve_trials, self._limit or None)
        new = {k: mode for k in written}
        new.update({k: mode for k in self._preserve_choices})
        if new == self._preserve_choices:
            return
        if len(new) > MAX_PRESERVE_CHOICES:
            new = {k: mode for k in written}
        self._preserve_choices = new
        modes = {k: m for k, m in new.items() if m != "keep"}
        keep = [k for k, m in new.items() if m == "keep"]
        self._session.set_preservation(modes, keep)

    @property
    def preservation_trials(self) -> list[Any]:
        """preserve="auto": the measured trials (mode, peak, cost) the choice was made from."""
        return list(self._preserve_trials)

    def _write_records(self) -> None:
        self._last_records = None  # converted from the session on first use (last_records)
        if self._records_path is None or not self._session.last_record_count:
            return
        try:
            with self._records_path.open("a") as f:
                for r in self.last_records:
                    f.write(json.dumps({"step": self._steps, **r}, sort_keys=True) + "\n")
        except OSError as e:  # runs in the step's `finally`: never mask the step's own exception
            warnings.warn(f"tapesac: cannot append records to {str(self._records_path)!r}: {e}", stacklevel=3)

    @property
    def last_records(self) -> list[dict[str, Any]]:
        """Execution records of the last step: one per replayed value (block, value, op, status, bytes, time_ns,
        detail), including the one a rejected or divergent replay was for."""
        if self._last_records is None:
            self._last_records = list(self._session.last_records())
        return list(self._last_records)

    @property
    def preservation(self) -> dict[int, str]:
        """preserve="auto"/"keep": the mode chosen per written storage (keys are storage identities)."""
        return dict(self._preserve_choices)

    def _replan_if_needed(self, st: StepStats) -> None:
        """Policy "auto": plans after the first step (which ran "full" while measuring), and again whenever a block
        call found no plan for its tape (new shapes or routing) or the measured peak exceeded the limit."""
        if self._planner is None or st.block_calls == 0:
            return
        limit = self._limit
        self._session.set_memory_limit(limit)
        measured = st.memory.peak_bytes if st.memory else 0
        if self._plan is not None:
            # What the peak model missed on the plan that ran: later plans keep that much below the limit.
            self._model_error = max(self._model_error, measured - self._plan["predicted_peak_bytes"])
        unplanned = any(not b.planned for b in st.blocks)
        over = measured > limit
        # The peak model is calibrated on the "full" measuring step and errs on the high side on the models we test
        # (README: the prediction vs measurement table). When the first plan's measured peak comes in below its
        # prediction, the model is re-calibrated once, halfway towards that measurement: the error varies between
        # plans, so going all the way (or re-calibrating again) could overshoot the limit with the next plan.
        predicted = self._plan["predicted_peak_bytes"] if self._plan is not None else 0
        # (The sequence model is calibrated on a complete measured profile and needs no such correction.)
        slack = (self._plan is not None and self._plan.get("model") == "additive"
                 and not self._plan["keeps_everything"] and predicted - measured > 0.01 * limit
                 and self._recalibrations < RECALIBRATIONS)
        if self._plan is not None and not unplanned and not over and not slack:
            return
        calibrate_on = measured
        if self._plan is None:
            reason = "first step"
        elif unplanned:
            reason = "new tape"
        elif over:
            reason = "measured peak over the limit"
        else:
            reason = "re-calibrated halfway to the plan's measured peak"
            calibrate_on = predicted - (predicted - measured) // 2
            self._recalibrations += 1
        # After a re-calibration the model is no longer conservative by construction: keep 1% of the limit spare.
        margin = max(self._model_error, int(0.01 * limit) if self._recalibrations else 0)
        info = dict(self._planner.plan(limit - margin, calibrate_on))
        # Graph replay: the static memory of the graphs not captured yet must fit beside the plan. A plan that keeps
        # everything replays nothing and needs no graph; otherwise the plan leaves room for the graphs when some
        # plan can, and else gets the whole limit while those blocks keep replaying eagerly (fallback memory_limit).
        reserve = self._session.graph_pending_bytes
        if reserve:
            capture = False
            if not info["keeps_everything"]:
                try:
                    info = dict(self._planner.plan(limit - margin - reserve, calibrate_on))
                    capture = True
                except MemoryLimitError:
                    pass
            self._session.set_graph_capture(capture)
            reserve = reserve if capture else 0
        info["graph_reserve_bytes"] = reserve
        info["predicted_peak_bytes"] += reserve
        info["limit"] = limit
        info["margin_bytes"] = margin
        info["reason"] = reason
        info["after_step"] = st.step
        info["measured_peak_bytes"] = measured
        self._plan = info
        self._plans.append({k: v for k, v in info.items() if k != "calls"})

    def _make_pre_hook(self, name: str) -> Callable[..., None]:
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

    def _make_post_hook(self, module: nn.Module) -> Callable[..., None]:
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

    def _close_open_blocks(self) -> None:
        while self._open:
            self._close_top_block()
        self._session.end_block()

    def _get_timeline(self) -> dict[str, Any]:
        """The last step's memory timeline, converted from the session on first use (valid until the next step ends)."""
        if self._timeline is None:
            raw = self._session.last_memory()
            self._timeline = {"timeline": [list(p) for p in raw["timeline"]],
                              "spans": [list(sp) for sp in raw["spans"]]}
        return self._timeline

    def _collect(self, seconds: float) -> StepStats:
        blocks = tuple(block_stats_from(b) for b in self._session.last_stats())
        for b in blocks:
            if b.capture_error:
                warnings.warn(f"tapesac: block {b.name}: {b.capture_error}; its tensors were kept", stacklevel=3)
        raw = self._session.last_memory(timeline=False)  # the timeline is converted on demand (_get_timeline)
        cuda_peak = None
        if self._device.type == "cuda":
            cuda_peak = int(torch.cuda.max_memory_allocated(self._device))
        memory = MemoryStats.from_session(raw, str(self._device), cuda_peak)
        self._timeline = None  # the session's last step; see _get_timeline
        return step_stats_from(
            summary=self._session.last_summary(),
            blocks=blocks,
            memory=memory,
            step=self._steps,
            policy=self._policy_label,
            step_ms=seconds * 1e3,
            ops_replayed_by_name=dict(self._session.last_replayed_by_name()),
            preserved=tuple(dict(p) for p in self._session.last_preserved()),
        )

    def _warn_unmatched(self) -> None:
        if self._warned_unmatched or not isinstance(self._save_op, _OpSetPolicy) or not self._last:
            return
        if self._last.ops_recorded == 0:
            return
        unmatched = self._save_op.unmatched()
        if unmatched:
            self._warned_unmatched = True
            warnings.warn(
                f"tapesac: policy entries {unmatched!r} matched no op whose output a block saved for backward, so "
                f"they keep nothing; check the names (ops are named as autograd sees them, e.g. 'aten::mm', "
                f"'aten::addmm', 'aten::bmm'; tapesac.record_ops(block, *inputs) lists a block's ops)",
                stacklevel=3,
            )

    def _write_log(self, stats: StepStats) -> None:
        if self._log_path is None:
            return
        record = {"schema_version": SCHEMA_VERSION, "kind": "step", **asdict(stats)}
        if stats.step in (1, 2, 10) or stats.step % 100 == 0:
            # The memory timeline on a few steps only (it is the bulk of a record), thinned to <= 1024 points.
            tl = self._get_timeline()
            pts = tl.get("timeline", [])
            stride = max(1, -(-len(pts) // 1024))
            record["timeline"] = {"timeline": pts[::stride], "spans": tl.get("spans", [])}
        try:
            with self._log_path.open("a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as e:  # runs in the step's `finally`: never mask the step's own exception
            warnings.warn(f"tapesac: cannot append telemetry to {str(self._log_path)!r}: {e}", stacklevel=3)

    @property
    def plan(self) -> dict[str, Any] | None:
        """Policy "auto": the plan in use (predicted peak and replay cost, per block call kept bytes), else None."""
        return self._plan

    def frontier(self, points: int = 12) -> "Frontier":
        """Policy "auto": the planner's memory/time frontier for the current tapes — the best plan's predicted step
        peak and replay time at ``points`` limits from the smallest feasible peak to the keep-everything peak —
        plus the steps measured so far. Needs one finished step."""
        from .frontier import Frontier

        if self._planner is None or self._plan is None:
            raise TapeSACError("frontier() needs policy='auto' (a memory_limit) and one finished step")
        if not isinstance(points, int) or isinstance(points, bool) or not 2 <= points <= 1000:
            raise ConfigError(f"frontier(points={points!r}): expected an int in [2, 1000]")
        planned = [
            {"limit_bytes": lim, "predicted_peak_bytes": peak, "predicted_replay_ms": cost / 1e6, "kept_bytes": kept}
            for lim, peak, cost, kept in self._planner.frontier(points)
        ]
        measured = [
            {"step": st.step, "peak_bytes": st.memory.peak_bytes if st.memory else 0, "replay_ms": st.replay_ms,
             "step_ms": st.step_ms, "policy": st.policy}
            for st in self._history
        ]
        return Frontier(planned=planned, measured=measured, limit_bytes=self._limit)

    @property
    def plans(self) -> list[dict[str, Any]]:
        """Policy "auto": every plan made so far (why, after which step, predicted vs measured peak)."""
        return list(self._plans)

    @property
    def memory_limit(self) -> int | None:
        """The step-peak limit in bytes (None: no limit). Settable with the same forms as the constructor."""
        return self._limit or None

    @memory_limit.setter
    def memory_limit(self, value: Any) -> None:
        limit = parse_memory_limit(value, self._device) or 0
        if self._planner is not None and limit == 0:
            raise ConfigError("policy='auto' needs a memory_limit; to run without one create a TapeSAC with "
                              "policy='full' or 'none'")
        self._session.set_memory_limit(limit)
        self._session.set_graph_memory_limit(limit)
        self._limit = limit
        if self._preserve_mode is not None and self._preserve_trials:
            # preserve="auto": choose again from the measured trials under the new limit.
            self._preserve_mode = _preserve.pick(self._preserve_trials, limit or None)
            self._preserve_choices = {k: self._preserve_mode for k in self._preserve_choices}
            modes = {k: m for k, m in self._preserve_choices.items() if m != "keep"}
            keep = [k for k, m in self._preserve_choices.items() if m == "keep"]
            self._session.set_preservation(modes, keep)
        if self._planner is not None and self._plan is not None:
            self._plan = None  # re-plan after the next step, under the new limit
            self._model_error = 0
            self._recalibrations = 0

    def report(self) -> "StepReport":
        """A StepReport of the steps run so far (the last step in detail)."""
        from .report import StepReport

        return StepReport.from_history(self._history, blocks=[n for n, _ in self._blocks], timeline=self._get_timeline(),
                                       total_steps=self._steps)

    def close(self) -> None:
        """Ends any open step and releases the runtime; the model is left exactly as it was."""
        if self._closed:
            return
        self._close_open_blocks()
        self._get_timeline()  # report() after close() still shows the last step's timeline
        self._session.shutdown()
        self._closed = True

    @property
    def approx(self) -> Approx | None:
        """The approximation in use (None: exact replay)."""
        return self._approx

    def __repr__(self) -> str:
        return f"TapeSAC(blocks={len(self._blocks)}, policy={self._policy_label!r}, steps={self._steps})"
