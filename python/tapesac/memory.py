"""Memory: the ``memory_limit`` parser, ``MemoryMeter`` and the per-step ``MemoryStats``.

What is counted (see allocator/include/tapesac/allocator/telemetry.h for the C++ contract):

* **CPU.** tapesac installs a counting layer over torch's CPU allocator while a ``TapeSAC`` or a ``MemoryMeter``
  is in use. A step counts the tensor bytes allocated *on the thread running the step* between the start and the
  end of ``with sac.step():`` and the frees of exactly those bytes. The step's memory *baseline* is the bytes of
  the model's parameters, buffers and gradients at step start; the *step peak* is baseline + the counter's peak.
  Optimizer state and tensors alive from outside the model are not in the baseline (they are constant during a
  step, so they shift every figure equally).
* **CUDA.** Device figures come from the caching allocator's own statistics (``torch.cuda.memory_stats``):
  the step peak is ``max_memory_allocated`` over the step.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from . import _C
from .errors import ConfigError

__all__ = ["MemoryMeter", "MemoryStats", "parse_memory_limit", "format_bytes", "physical_memory_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_LIMIT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")
# The runtime counts bytes in signed 64 bits.
MAX_LIMIT_BYTES = 2**63 - 1


def format_bytes(n: float) -> str:
    """``"1.50 GiB"``, ``"12.00 MiB"``, ``"512 B"``."""
    return _C.format_bytes(int(n))


def physical_memory_bytes() -> int:
    """Physical RAM of this machine (the base of a CPU percentage limit)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        raise ConfigError("memory_limit as a percentage needs the machine's physical memory size, which this "
                          "platform does not report; pass bytes or a string like '20GiB'") from None


def _total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return physical_memory_bytes()


def parse_memory_limit(value: Any, device: torch.device | str = "cpu") -> int | None:
    """Bytes of a ``memory_limit``: ``None``; an int of bytes; ``"20GiB"``, ``"512 MB"``, ``"1.5e9"``; ``"90%"`` of
    the device's memory (CPU: physical RAM). Raises ConfigError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"memory_limit={value!r}: expected bytes (int), a size like '20GiB' or a percentage like "
                          f"'90%'")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"memory_limit={value}: a limit must be a positive number of bytes (or None for none)")
        if value > MAX_LIMIT_BYTES:
            raise ConfigError(f"memory_limit={value}: more bytes than a 64-bit count holds (at most "
                              f"{MAX_LIMIT_BYTES}); pass the limit you mean, or None for no limit")
        return value
    if isinstance(value, float):
        raise ConfigError(f"memory_limit={value!r}: pass bytes as an int, a size string like '20GiB', or a "
                          f"percentage string like '90%'")
    if not isinstance(value, str):
        raise ConfigError(f"memory_limit must be None, an int of bytes, a size like '20GiB' or a percentage like "
                          f"'90%'; got {type(value).__name__}")
    m = _LIMIT_RE.match(value)
    if not m:
        raise ConfigError(f"memory_limit={value!r} is not a size: expected e.g. '20GiB', '512MB', '1.5e9' or '90%'")
    number, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if not 0 < number <= 100:
            raise ConfigError(f"memory_limit={value!r}: a percentage must be in (0, 100]")
        try:
            total = _total_memory(torch.device(device))
        except (RuntimeError, TypeError, ValueError) as e:  # no driver, an unknown device: typed (adversarial test)
            raise ConfigError(f"memory_limit={value!r}: cannot read the memory of device {device!r} for a "
                              f"percentage ({type(e).__name__}: {str(e).splitlines()[0]}); pass bytes instead") from None
        limit = int(total * number / 100)
        if limit < 1:  # it used to become 0 bytes, which means "no limit"
            raise ConfigError(f"memory_limit={value!r}: that percentage of {total} bytes is less than one byte; a "
                              f"limit must be positive (or None for none)")
        return limit
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"memory_limit={value!r}: unknown unit {unit!r}; use B, KB/MB/GB/TB (powers of 1000) or "
                          f"KiB/MiB/GiB/TiB (powers of 1024), or a percentage like '90%'")
    # An integer count of bytes (or of whole units) is exact: float() rounded '123456789012345679' to ...680.
    digits = m.group(1).strip()
    size = int(digits) * factor if digits.isdigit() and digits.isascii() else number * factor
    if not math.isfinite(size) or size > MAX_LIMIT_BYTES:
        raise ConfigError(f"memory_limit={value!r}: more bytes than a 64-bit count holds (at most "
                          f"{MAX_LIMIT_BYTES}, about 8 EiB); pass the limit you mean, or None for no limit")
    limit = int(size)
    if limit <= 0:
        raise ConfigError(f"memory_limit={value!r}: a limit must be positive")
    return limit


class MemoryMeter:
    """Counts the tensor memory allocated inside a ``with`` block on this thread (and its frees, anywhere).

    ``peak_bytes``: the peak of (bytes allocated inside the block and still alive), relative to entry;
    ``current_bytes``: those still alive now; ``allocated_bytes``: the total allocated. With ``device="cuda"``
    (or a CUDA device) the figures come from the caching allocator instead (``max_memory_allocated`` over the
    block, relative to entry). Nested meters and a ``sac.step()`` inside or around a meter all count.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"MemoryMeter(device={device!r}): expected 'cpu' or a CUDA device")
        self._meter: Any = None
        self._counter: Any = None
        self._start_cuda = 0
        self._final: dict[str, int] | None = None

    def __enter__(self) -> "MemoryMeter":
        if self._meter is not None:
            raise ConfigError("this MemoryMeter is already in use; create one meter per `with` block")
        self._final = None
        self._counter = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_cuda = torch.cuda.memory_allocated(self.device)
            self._meter = True
        else:
            meter = _C.MemoryMeter()
            meter.start()
            self._meter = meter
        return self

    def __exit__(self, *exc: Any) -> None:
        self._final = self._read()
        if self.device.type == "cpu":
            self._meter.stop()
            self._counter = self._meter
        self._meter = None

    def _read(self) -> dict[str, int]:
        if self._counter is not None and self._meter is None:  # CPU, after the block: frees still count
            return dict(self._counter.gauge())
        if self._meter is None:
            return self._final or {"current": 0, "peak": 0, "allocated": 0, "allocations": 0}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stats = torch.cuda.memory_stats(self.device)
            return {
                "current": torch.cuda.memory_allocated(self.device) - self._start_cuda,
                "peak": torch.cuda.max_memory_allocated(self.device) - self._start_cuda,
                "allocated": int(stats.get("allocated_bytes.all.allocated", 0)),
                "allocations": int(stats.get("allocation.all.allocated", 0)),
            }
        return dict(self._meter.gauge())

    @property
    def peak_bytes(self) -> int:
        return int(self._read()["peak"])

    @property
    def current_bytes(self) -> int:
        return int(self._read()["current"])

    @property
    def allocated_bytes(self) -> int:
        return int(self._read()["allocated"])

    @property
    def allocations(self) -> int:
        """Number of allocations counted."""
        return int(self._read()["allocations"])


def frozen_from(cls: type, values: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass `cls` (no __post_init__) whose fields are `values` (every field, no other
    key): what its __init__ builds, without one object.__setattr__ per field. Statistics are built every step, one
    per block call (issue 20: the step's fixed cost)."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


@dataclass(frozen=True)
class PhaseMemory:
    """One phase of a step (forward, backward, replay): bytes allocated in it (and still alive at step end), and
    the step counter's peak while in it (relative to step start)."""

    allocated_bytes: int
    alive_bytes: int
    peak_bytes: int
    allocations: int


@dataclass(frozen=True)
class MemoryStats:
    """The memory of one step. ``peak_bytes`` is the step peak (baseline + the peak of the step's allocations)."""

    device: str
    baseline_bytes: int
    peak_bytes: int
    peak_above_baseline_bytes: int
    allocated_bytes: int
    end_bytes: int
    phases: dict[str, PhaseMemory] = field(default_factory=dict)
    arena_bytes: int = 0
    arena_separate_bytes: int = 0
    replay_pieces: int = 0
    memory_limit: int | None = None

    @classmethod
    def from_session(cls, raw: dict[str, Any], device: str, cuda_peak: int | None = None) -> "MemoryStats":
        total = raw["total"]
        phases = {
            name: frozen_from(PhaseMemory, {"allocated_bytes": g["allocated"], "alive_bytes": g["current"],
                                            "peak_bytes": g["peak"], "allocations": g["allocations"]})
            for name, g in raw["phases"].items()
        }
        baseline = int(raw["baseline_bytes"])
        above = int(total["peak"])
        peak = baseline + above
        if cuda_peak is not None:  # the caching allocator's own figure is the truth on a device
            peak, above = cuda_peak, max(0, cuda_peak - baseline)
        return frozen_from(cls, {
            "device": device,
            "baseline_bytes": baseline,
            "peak_bytes": peak,
            "peak_above_baseline_bytes": above,
            "allocated_bytes": int(total["allocated"]),
            "end_bytes": int(total["current"]),
            "phases": phases,
            "arena_bytes": int(raw["arena_shared_bytes"]),
            "arena_separate_bytes": int(raw["arena_separate_bytes"]),
            "replay_pieces": int(raw["replay_pieces"]),
            "memory_limit": int(raw["memory_limit"]) or None,
        })

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MemoryStats":
        d = dict(d)
        d["phases"] = {k: PhaseMemory(**v) for k, v in d.get("phases", {}).items()}
        return cls(**d)
