"""Step statistics: ``BlockStats`` (one block call) and ``StepStats`` (one step), frozen dataclasses.

Both are built from the C++ field list (``replay/block_stats.h``, Note [Statistics defined once]): the fields, their
types and their docs come from ``_C.block_stats_schema()``, so adding a counter is one line in C++. The only
conversion is the unit table below: ``*_ns`` fields (nanoseconds) are reported as ``*_ms`` (milliseconds, float).
A step's totals are computed in C++ (``replay/step_summary.h``): the sum of the fields whose schema says "sum", the
largest value of those that say "max".
"""

from __future__ import annotations

import dataclasses
from dataclasses import field, make_dataclass
from typing import Any, Callable

from . import _C
from .memory import MemoryStats, format_bytes, frozen_from

__all__ = ["BlockStats", "StepStats", "SCHEMA_VERSION", "append_to_history", "block_stats_from", "blocks_on_demand",
           "capture_errors", "step_stats_from"]

# Version of the JSON records written from these classes (TapeSAC(log=...), StepReport).
SCHEMA_VERSION = 2

# suffix in C++ -> (suffix in Python, factor): the one unit conversion.
_UNITS = {"_ns": ("_ms", 1e-6)}

_TYPES: dict[str, tuple[type, Any]] = {"int": (int, 0), "bool": (bool, False), "str": (str, ""),
                                       "op_times": (tuple, ())}


def _convert(name: str, kind: str) -> tuple[str, type, Any, Callable[[Any], Any]]:
    """(Python name, type, default, converter of the C++ value) of one schema field."""
    typ, default = _TYPES[kind]
    for suffix, (new_suffix, factor) in _UNITS.items():
        if name.endswith(suffix):
            py_name = name[: -len(suffix)] + new_suffix
            if kind == "op_times":
                return py_name, tuple, (), lambda v, f=factor: tuple((int(i), str(n), t * f) for i, n, t in v)
            return py_name, float, 0.0, lambda v, f=factor: v * f
    if kind == "op_times":
        return name, tuple, (), lambda v: tuple(tuple(x) for x in v)
    return name, typ, default, typ


_SCHEMA = [(name, kind, combine, doc) for name, kind, combine, doc in _C.block_stats_schema()]
# Python name -> (C++ name, converter); in schema order.
_BLOCK_FIELDS = {}
for _name, _kind, _combine, _doc in _SCHEMA:
    _py, _typ, _default, _conv = _convert(_name, _kind)
    _BLOCK_FIELDS[_py] = (_name, _conv, _typ, _default, _combine, _doc)
# The fields a StepStats carries as the step's total ("sum") or largest value ("max") over its block calls.
_SUMMED = [py for py, spec in _BLOCK_FIELDS.items() if spec[4]]
_HOW = {"sum": " (summed over the block calls)", "max": " (the largest over the block calls)"}


def _doc(summary: str, names: list[str], extra: dict[str, str] | None = None) -> str:
    lines = [summary, "", "Attributes:"]
    lines += [f"    {n}: {d}" for n, d in (extra or {}).items()]
    lines += [f"    {n}: {_BLOCK_FIELDS[n][5]}" + (_HOW.get(_BLOCK_FIELDS[n][4], "") if extra else "") for n in names]
    return "\n".join(lines)


def _short(st: Any) -> str:
    """One line per object: what a person looks for first."""
    parts = [f"saved {st.saved_tensors}", f"kept {st.kept_tensors} ({format_bytes(st.kept_bytes)})",
             f"dropped {st.dropped_tensors} ({format_bytes(st.dropped_bytes)})"]
    if st.opaque_tensors:
        parts.append(f"opaque {st.opaque_tensors}")
    parts.append(f"replays {st.replays} ({st.ops_replayed} ops, {st.replay_ms:.2f} ms)")
    return ", ".join(parts)


def _block_str(self: Any) -> str:
    return f"BlockStats({self.name}: {_short(self)})"


def _step_str(self: Any) -> str:
    peak = f", peak {format_bytes(self.memory.peak_bytes)}" if self.memory is not None else ""
    return (f"StepStats(step {self.step}, policy {self.policy}, {self.block_calls} block calls, "
            f"{self.step_ms:.1f} ms{peak}; {_short(self)})")


BlockStats = make_dataclass(
    "BlockStats",
    [(py, spec[2], field(default=spec[3])) for py, spec in _BLOCK_FIELDS.items()],
    frozen=True,
    kw_only=True,
    namespace={"__str__": _block_str},
)
BlockStats.__module__ = __name__
BlockStats.__doc__ = _doc("One block call of a step. Bytes count unique storages; parameters and buffers are not "
                          "counted as kept. ``str()`` is a one-line summary; ``repr()`` shows every field.",
                          list(_BLOCK_FIELDS))

_STEP_EXTRA: dict[str, tuple[type, Any, str]] = {
    "step": (int, 0, "the step's number (1 for the first)"),
    "policy": (str, "", "the policy label ('none', 'full', 'auto', 'save_ops', 'callable')"),
    "block_calls": (int, 0, "block calls recorded in the step"),
    "step_ms": (float, 0.0, "wall time of the step (the `with sac.step():` block)"),
    "blocks": (tuple, (), "the BlockStats of every block call, in order"),
    "ops_replayed_by_name": (dict, None, "replayed op counts by op name"),
    "memory": (object, None, "the step's MemoryStats"),
    "preserved": (tuple, (), "storages written in place after a block read them (see TapeSAC(preserve=...)): "
                             "mode, bytes, writes, held bytes, save/restore time"),
    "record_counts": (dict, None, "the step's replay records by status ('match', 'recovered', ...)"),
    "graph_fallback_reasons": (dict, None, "graph backend: block calls by the reason of their last eager fallback"),
    "op_timing": (str, "", "the blocks' op-time sources (BlockStats.op_timing), comma-separated when they differ"),
    "over_limit": (bool, False, "the step's measured peak exceeded memory_limit, by over_limit_bytes (warned once "
                                "through the 'tapesac' logger; under a planner — policy 'auto', or planned "
                                "schedules — the next step tightens; one-segment schedules and policy 'none' do not "
                                "replan)"),
}


def _step_field(name: str, typ: type, default: Any) -> tuple[str, type, Any]:
    if default is None and typ is dict:
        return (name, typ, field(default_factory=dict))
    return (name, typ, field(default=default))


StepStats = make_dataclass(
    "StepStats",
    [_step_field(n, t, d) for n, (t, d, _) in _STEP_EXTRA.items()]
    + [(py, _BLOCK_FIELDS[py][2], field(default=_BLOCK_FIELDS[py][3])) for py in _SUMMED],
    frozen=True,
    kw_only=True,
    namespace={"__str__": _step_str},
)
StepStats.__module__ = __name__
StepStats.__doc__ = _doc("What one step did: its block calls, its memory, and the sums over its block calls of the "
                         "fields below. ``str()`` is a one-line summary; ``repr()`` shows every field.",
                         _SUMMED, {n: d for n, (_, _, d) in _STEP_EXTRA.items()})


# The fields whose C++ value is not already the Python one (units, op times); the others are taken as they are.
_BLOCK_CONVERTED = [(py, spec[1]) for py, spec in _BLOCK_FIELDS.items() if spec[1] not in (int, bool, str)]
_BLOCK_NAMES = list(_BLOCK_FIELDS)  # Python names in schema order (the order of Session.last_stats_rows())
_STEP_FIELD_SET = frozenset(f.name for f in dataclasses.fields(StepStats))
_SUM_CONVERT = [(py, _BLOCK_FIELDS[py][0], _BLOCK_FIELDS[py][1]) for py in _SUMMED]
_STEP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StepStats) if f.default is not dataclasses.MISSING}
_STEP_FACTORIES = {f.name: f.default_factory for f in dataclasses.fields(StepStats)
                   if f.default_factory is not dataclasses.MISSING}


def block_stats_from(raw: dict[str, Any] | tuple[Any, ...]) -> Any:
    """A BlockStats from what the session returns (C++ names and units): a dict of fields (Session.last_stats()) or
    a row of values in schema order (Session.last_stats_rows(), what a step uses: no key strings built)."""
    if isinstance(raw, dict):
        values = {py: raw[spec[0]] for py, spec in _BLOCK_FIELDS.items()}
    else:
        values = dict(zip(_BLOCK_NAMES, raw, strict=True))
    for py, conv in _BLOCK_CONVERTED:
        values[py] = conv(values[py])
    return frozen_from(BlockStats, values)


# Note [Block statistics on demand]. A step's StepStats.blocks holds one BlockStats per block call, ~43k instructions
# each to build in Python (53 fields) -- 2.1 M a step for 48 blocks, most of what a step of perf/bench_record.py's
# "blocks" workload costs beyond plain PyTorch, and read by nobody in most steps. So a step keeps the session's rows
# (one tuple of C++ values per block call, Session.last_stats_rows()) and StepStats.blocks converts them the first
# time it is read (then holds the tuple): every reader (attribute, ==, repr, dataclasses.asdict, copy, pickle) sees
# the same tuple of BlockStats as before. What a step needs at once (a block's capture error) is read off the rows.
class _PendingBlocks:
    """The rows of a step's block calls, not yet BlockStats (Note [Block statistics on demand])."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows

    def convert(self) -> tuple[Any, ...]:
        return tuple(block_stats_from(r) for r in self.rows)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # a copy or a pickle holds the BlockStats
        return (tuple, (self.convert(),))


def blocks_on_demand(rows: list[tuple[Any, ...]]) -> Any:
    """What step_stats_from takes as `blocks` for the session's rows: converted when StepStats.blocks is first read."""
    return _PendingBlocks(rows)


_NAME_AT = _BLOCK_NAMES.index("name")
_ERROR_AT = _BLOCK_NAMES.index("capture_error")


def capture_errors(rows: list[tuple[Any, ...]]) -> list[tuple[str, str]]:
    """(block name, capture error) of the rows' block calls whose capture failed."""
    return [(r[_NAME_AT], r[_ERROR_AT]) for r in rows if r[_ERROR_AT]]


def _get_blocks(self: Any) -> tuple[Any, ...]:
    d = self.__dict__
    v = d.get("blocks", ())
    if type(v) is _PendingBlocks:
        v = d["blocks"] = v.convert()
    return v


def _set_blocks(self: Any, value: Any) -> None:  # the dataclass __init__'s object.__setattr__ (frozen otherwise)
    self.__dict__["blocks"] = value


StepStats.blocks = property(_get_blocks, _set_blocks, doc="the BlockStats of every block call, in order")


def step_stats_from(*, summary: dict[str, Any], blocks: tuple[Any, ...], memory: MemoryStats | None,
                    **extra: Any) -> Any:
    """A StepStats from the session's step summary (C++ totals), the step's BlockStats and the given fields."""
    totals = summary["totals"]
    if not _STEP_FIELD_SET.issuperset(extra):
        raise TypeError(f"step_stats_from: StepStats has no field(s) {sorted(set(extra) - _STEP_FIELD_SET)}")
    values = dict(_STEP_DEFAULTS)
    for name, factory in _STEP_FACTORIES.items():
        values[name] = factory()
    values.update({py: conv(totals[name]) for py, name, conv in _SUM_CONVERT})
    values.update(extra)
    values.update(blocks=blocks, memory=memory, block_calls=int(summary["block_calls"]),
                  over_limit=int(totals["over_limit_bytes"]) > 0,
                  graph_fallback_reasons=dict(summary["graph_fallback_reasons"]),
                  record_counts=dict(summary["record_counts"]), op_timing=summary["op_timing"])
    return frozen_from(StepStats, values)


def as_dict(stats: Any) -> dict[str, Any]:
    """The JSON form of a StepStats or BlockStats (nested dataclasses included)."""
    return dataclasses.asdict(stats)


def append_to_history(history: Any, st: Any, detail_steps: int) -> None:
    """Appends `st` to `history` (a bounded deque of StepStats) and drops the per-block tuple of the entry
    `detail_steps` back. Note [History without per-block detail]: a StepStats holds one BlockStats per block call (an
    object and its dict each): 1,000 steps of a 48-block model kept ~95k more objects alive, which Python's cyclic GC
    traversed in every full collection (3 of ~100 ms in 3,000 steps of perf/bench_record.py's 48-block workload, 121 us
    per step on average). Older entries have blocks=() (block_calls and every total still count them); TapeSAC(log=...)
    writes every step whole."""
    history.append(st)
    n = len(history)
    if n > detail_steps and history[n - 1 - detail_steps].__dict__.get("blocks"):  # not converted for this
        old = history[n - 1 - detail_steps]
        history[n - 1 - detail_steps] = frozen_from(type(old), {**old.__dict__, "blocks": ()})
