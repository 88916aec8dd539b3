"""The options of a TapeSAC: ``Config`` (one frozen keyword-only dataclass, every field documented and validated here)
and ``Approx`` (the approximate rematerialization options).

``TapeSAC(model, **options)`` builds a ``Config`` from its keywords (or takes one: ``TapeSAC(model, config)``); a bad
value raises ConfigError naming the accepted values. Values that depend on the model (the device a percentage limit
refers to, the backend ``"auto"`` picks, the policy ``None`` means) are resolved by TapeSAC, not here.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from torch import nn

from .errors import ConfigError
from .memory import parse_memory_limit
from .policy import parse_policy

__all__ = ["Config", "Approx", "BACKENDS", "CONTRACTS", "GRAPH_TIMINGS", "PRESERVE_MODES", "SCHEDULES",
           "APPROX_METHODS", "APPROX_TARGETS"]

Backend = Literal["auto", "eager", "cuda_graph", "emulated_graph"]
GraphTiming = Literal["first", "every", "off"]
Contract = Literal["check", "strict", "off"]
Preserve = Literal["auto", "regions", "snapshots", "keep", "off"]
Schedule = Literal["auto", "one_segment", "planned", "hold_all", "lazy"]
BACKENDS: tuple[str, ...] = get_args(Backend)
GRAPH_TIMINGS: tuple[str, ...] = get_args(GraphTiming)
CONTRACTS: tuple[str, ...] = get_args(Contract)
PRESERVE_MODES: tuple[str, ...] = get_args(Preserve)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
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
    method: Literal["sketch", "greedy"] = "sketch"
    targets: tuple[str, ...] = ("mlp", "attn")
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, numbers.Real) or not (
            0 < self.fraction <= 1
        ):
            raise ConfigError(f"Approx(fraction={self.fraction!r}): expected a number in (0, 1], e.g. 2/3")
        object.__setattr__(self, "fraction", float(self.fraction))  # a numpy scalar too (np.float32 was refused)
        if self.method not in APPROX_METHODS:
            raise ConfigError(f"Approx(method={self.method!r}): expected one of {list(APPROX_METHODS)}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (tuple, list)) or not targets or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"Approx(targets={self.targets!r}): expected a non-empty tuple of {list(APPROX_TARGETS)}")
        for t in targets:
            if t not in APPROX_TARGETS:
                raise ConfigError(f"Approx(targets={self.targets!r}): unknown target {t!r}; expected {list(APPROX_TARGETS)}")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(targets)))
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < 2**64:
            raise ConfigError(f"Approx(seed={self.seed!r}): expected an int in [0, 2**64)")
        object.__setattr__(self, "seed", int(self.seed))


def _doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    """A field with its documentation (``Config.__doc__`` and TapeSAC's are assembled from these)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True, kw_only=True)
class Config:
    blocks: Any = _doc(
        "the recorded, checkpointed units: an nn.ModuleList, a list of modules, a module class, a class name, or a "
        "dotted path with ``*`` (``\"model.layers.*\"``). Nested matches are merged into the outermost block.",
        "model.layers.*")
    policy: Any = _doc(
        "``\"full\"`` (keep only block inputs and opaque tensors; replay the rest on demand), ``\"none\"`` (keep "
        "everything; only record and measure), a set of op names whose outputs are kept (``{\"aten::mm\"}``, "
        "``torch.ops.aten.mm``, ``torch.ops.aten.mm.default``), or a callable ``f(op_name) -> bool`` (True keeps; "
        "called once per distinct op overload), or ``\"auto\"``: the planner keeps the values whose replay costs the "
        "most time per byte, so that the predicted step peak stays under ``memory_limit`` (the first step runs "
        "``\"full\"`` while measuring op times and the peak; the plan applies from the second step and is redone "
        "when a tape changes or a measured peak exceeds the limit). Default (None): ``\"auto\"`` with a "
        "``memory_limit``, else ``\"full\"``.", None)
    memory_limit: Any = _doc(
        "the step-peak limit: bytes (int), a size (``\"20GiB\"``, ``\"512MB\"``) or a percentage of the device's "
        "memory (``\"90%\"``; on CPU of physical RAM). Enforced during replay: a replay that would not fit runs in "
        "pieces, and one that cannot fit raises MemoryLimitError. With a limit, the default policy is ``\"auto\"``.",
        None)
    backend: Backend = _doc(
        "``\"auto\"``, ``\"eager\"``, ``\"cuda_graph\"`` or ``\"emulated_graph\"``. ``\"cuda_graph\"`` replays each "
        "block as a pruned CUDA graph (one capture per distinct block, after one eager warm-up replay; a block that "
        "cannot be captured or launched replays eagerly, and ``StepStats``/``BlockStats`` say why); it needs a CUDA "
        "model and a build with the GPU backend (ConfigError otherwise). ``\"auto\"`` picks ``\"cuda_graph\"`` when "
        "both are there, else ``\"eager\"``. ``\"emulated_graph\"`` runs the same graph replayer with an emulated "
        "executable graph on any device (for tests; slower than eager). ``TapeSAC.backend`` holds the choice.",
        "auto")
    graph_timing: GraphTiming = _doc(
        "with a graph backend, which launches are timed per op (``BlockStats.graph_op_ms``): ``\"first\"`` the "
        "first launch of each graph, ``\"every\"`` every launch, ``\"off\"`` none. On CUDA a timed launch is "
        "measured by CUPTI (the device time of each op's kernels) and costs one device synchronisation; when a "
        "profiler holds CUPTI the launch runs untimed and ``graph_timing_note`` says so.", "first")
    contract: Contract = _doc(
        "``\"check\"`` (version checks on every tensor replay reads and every saved tensor, metadata checks on every "
        "replayed output), ``\"strict\"`` (also a byte checksum of each dropped tensor at forward, compared after "
        "replay: a mismatch raises ReplayContractError), or ``\"off\"`` (no checks; unsafe).", "check")
    approx: Approx | None = _doc(
        "a ``tapesac.Approx``: replay recomputes only a fraction of each gated MLP's hidden units and/or each "
        "attention's heads (greedy, or an unbiased sketch); the loss stays exact, gradients become estimates. None: "
        "exact replay.", None)
    log: str | os.PathLike | None = _doc(
        "a path: one JSON line per step (the step's statistics and memory) is appended to it.", None)
    preserve: Preserve = _doc(
        "how a replay sees a tensor that the step wrote in place after the block's forward read it (a memory bank, a "
        "queue, a modified input): ``\"regions\"`` saves the overwritten regions just before each write, "
        "``\"snapshots\"`` copies the whole tensor at its first write, ``\"keep\"`` keeps the activations whose "
        "replay reads it (from the second step; the first uses regions), ``\"auto\"`` chooses per tensor from the "
        "measured costs of the previous steps, ``\"off\"`` rejects such replays with ReplayContractError. Writes "
        "must happen on the step's thread; others are detected by version counters and rejected.", "auto")
    records: str | os.PathLike | None = _doc(
        "a path: one JSON line per replayed value (block, value, op, status match / recovered / rejected / "
        "divergent, or approximated with ``approx``, bytes, time) is appended to it; ``TapeSAC.last_records`` holds "
        "the last step's.", None)
    schedule: Schedule = _doc(
        "when a block's backward replays its dropped values (README, \"Replay schedules\"): ``\"auto\"`` (the "
        "default) is ``\"planned\"`` for policies ``\"full\"``, op sets and callables and ``\"one_segment\"`` "
        "for ``\"auto\"``, ``\"none\"`` and with ``approx``; ``\"one_segment\"`` all of them at its first "
        "unpack; ``\"planned\"`` in segments by the order backward unpacks them, planned between steps from the "
        "measured op costs and bytes (``\"full\"``, op sets and callables: within ``schedule_budget``, or under "
        "``memory_limit``, where a block call without a plan yet replays lazily; ``\"auto\"`` with its keep plan, "
        "experimental; not with ``approx``); ``\"hold_all\"`` one segment per value holding what later segments "
        "read (no recompute); ``\"lazy\"`` one segment per value holding nothing (the least alive, the most "
        "recompute).", "auto")
    schedule_budget: float | None = _doc(
        "with planned schedules and no ``memory_limit`` (policies ``\"full\"``, op sets, callables): the extra "
        "replay time the schedules may cost to lower the step peak, as a fraction of one replay per block call "
        "(predicted from measured op times; 0: only schedules that replay no more than one segment would). None: "
        "the least peak any schedules reach (within 2%), whatever it costs.", 0.1)

    def __post_init__(self) -> None:
        parse_memory_limit(self.memory_limit)  # the syntax; TapeSAC resolves percentages on the model's device
        if not isinstance(self.blocks, (str, list, tuple, nn.Module)) and not (
                isinstance(self.blocks, type) and issubclass(self.blocks, nn.Module)):
            raise ConfigError(f"blocks must be an nn.ModuleList, a list of modules, a module class, a class name or a "
                              f"dotted path with * (e.g. 'model.layers.*'); got {type(self.blocks).__name__}")
        if self.policy is not None:
            parse_policy(self.policy)
            if isinstance(self.policy, set):  # a Config is hashable like any frozen dataclass (hash() raised)
                object.__setattr__(self, "policy", frozenset(self.policy))
        for name, choices in (("backend", BACKENDS), ("graph_timing", GRAPH_TIMINGS), ("contract", CONTRACTS),
                              ("preserve", PRESERVE_MODES), ("schedule", SCHEDULES)):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"{name}={value!r} is not supported; expected one of {list(choices)}")
        for name, what in (("log", "JSON-lines telemetry"), ("records", "JSON-lines execution records")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{name} must be a file path (str or os.PathLike) for the {what}, got "
                                  f"{type(value).__name__}")
        budget = self.schedule_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not 0 <= budget <= 100):
            raise ConfigError(f"schedule_budget must be None or a number in [0, 100] (extra replay time as a fraction "
                              f"of one replay per block call, e.g. 0.1), got {budget!r}")
        if self.approx is not None and not isinstance(self.approx, Approx):
            raise ConfigError(f"approx must be a tapesac.Approx(fraction=..., method=..., targets=...) or None, got "
                              f"{type(self.approx).__name__}")
        if self.approx is not None and self.contract == "strict":
            raise ConfigError("approx cannot run with contract='strict' (which checks that replay rebuilds every "
                              "dropped tensor byte for byte); use contract='check' with approx")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "Config":
        """A Config from keyword options; an unknown name raises ConfigError listing the accepted ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(f"unknown TapeSAC option(s) {unknown}; expected keywords among {names}")
        return cls(**options)

    def replace(self, **options: Any) -> "Config":
        """A copy with some options changed (validated again)."""
        return Config.from_options({**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **options})


def resolve_schedule(schedule: str, policy_label: str, approx: bool) -> str:
    """The schedule a TapeSAC runs (Config.schedule): ``"auto"`` is ``"planned"`` for the policies that choose what
    they keep themselves ("full", op sets, callables) and ``"one_segment"`` for ``"auto"`` (whose planned
    schedules are experimental), ``"none"`` (nothing is replayed) and with ``approx`` (approximate replays run as one
    segment); ``"planned"`` is ``"one_segment"`` under "none" and with approx."""
    if schedule == "auto":
        return "planned" if policy_label not in ("auto", "none") and not approx else "one_segment"
    if schedule == "planned" and (policy_label == "none" or approx):
        return "one_segment"
    return schedule


def options_doc() -> str:
    """The Args section of TapeSAC's docstring: one entry per Config field."""
    import textwrap

    lines = []
    for f in dataclasses.fields(Config):
        lines.append(textwrap.fill(f"{f.name}: {f.metadata['doc']}", width=112, initial_indent="        ",
                                   subsequent_indent="            "))
    return "\n".join(lines)


Config.__doc__ = ("The options of a TapeSAC (every keyword of ``TapeSAC(model, ...)``); frozen, validated on "
                  "construction.\n\n    Attributes:\n" + options_doc())
