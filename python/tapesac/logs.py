"""What a TapeSAC writes to files: the JSON-lines step log (``TapeSAC(log=path)``: one StepStats per line, the memory
timeline on a few steps) and the execution records (``TapeSAC(records=path)``: one line per replayed value).

Both files are opened for appending when the TapeSAC is made (a bad path fails there, with ConfigError) and
written at the end of every step, in the step's ``finally``: a write error is a warning (the ``tapesac`` logger),
never an exception that would mask the step's own. Records are converted from the C++ session only when a file or
``last_records`` asks.
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError
from .log import logger
from .stats import SCHEMA_VERSION, as_dict

__all__ = ["StepLog", "TIMELINE_STEPS", "TIMELINE_POINTS"]

# The memory timeline is the bulk of a record: logged on these steps and every 100th, thinned to <= 1024 points.
TIMELINE_STEPS = (1, 2, 10)
TIMELINE_POINTS = 1024


def _open_for_append(what: str, path: str | os.PathLike | None) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    try:
        p.open("a").close()
    except OSError as e:
        raise ConfigError(f"{what}={str(p)!r} cannot be opened for appending ({e}); pass a writable file path") from None
    return p


# The files the live StepLogs write, by resolved path: two writers interleave their lines into a file no reader can
# split (an adversarial test: StepReport.from_jsonl then failed, or mixed the two runs).
_WRITERS: dict[Path, "weakref.ref[StepLog]"] = {}


def _claim(owner: "StepLog", what: str, path: Path | None) -> None:
    if path is None:
        return
    key = path.resolve()
    for dead in [k for k, ref in _WRITERS.items() if ref() is None or ref().closed]:
        del _WRITERS[dead]  # one entry per file written by a live StepLog: a run making many TapeSACs keeps none
    other = _WRITERS.get(key)
    holder = other() if other is not None else None
    if holder is not None and holder is not owner and not holder.closed:
        raise ConfigError(f"{what}={str(path)!r} is written by another TapeSAC that is still open; give each TapeSAC its "
                          f"own file, or close() the other first")
    _WRITERS[key] = weakref.ref(owner)


class StepLog:
    """The step log and the execution records of one TapeSAC."""

    def __init__(self, log: str | os.PathLike | None, records: str | os.PathLike | None) -> None:
        if log is not None and records is not None and Path(log).resolve() == Path(records).resolve():
            raise ConfigError(f"log and records name the same file ({str(log)!r}): the step log and the execution "
                              f"records are two JSON-lines files; give records= another path")
        self.closed = False
        self.log_path = _open_for_append("log", log)
        self.records_path = _open_for_append("records", records)
        _claim(self, "log", self.log_path)
        _claim(self, "records", self.records_path)
        self._records: list[dict[str, Any]] | None = []
        self._session: Any = None

    def close(self) -> None:
        """The files are free for another TapeSAC (the last step's records stay readable)."""
        self.closed = True

    def write_step(self, stats: Any, timeline: Callable[[], dict[str, Any]]) -> None:
        """Appends one step record; `timeline` returns the step's memory timeline (called only when logged)."""
        if self.log_path is None:
            return
        record = {"schema_version": SCHEMA_VERSION, "kind": "step", **as_dict(stats)}
        if stats.step in TIMELINE_STEPS or stats.step % 100 == 0:
            tl = timeline()
            pts = tl.get("timeline", [])
            stride = max(1, -(-len(pts) // TIMELINE_POINTS))
            record["timeline"] = {"timeline": pts[::stride], "spans": tl.get("spans", [])}
        self._append(self.log_path, "telemetry", [record])

    def write_records(self, step: int, session: Any) -> None:
        """Takes the session's records of the step that just ended (converted lazily) and appends them."""
        self._records = None
        self._session = session
        if self.records_path is None or not session.last_record_count:
            return
        self._append(self.records_path, "records", [{"step": step, **r} for r in self.last_records()])

    def last_records(self) -> list[dict[str, Any]]:
        """The execution records of the last step (valid until the next step ends)."""
        if self._records is None:
            self._records = list(self._session.last_records())
        return list(self._records)

    @staticmethod
    def _append(path: Path, what: str, lines: list[dict[str, Any]]) -> None:
        try:
            with path.open("a") as f:
                for line in lines:
                    f.write(json.dumps(line, sort_keys=True) + "\n")
        except OSError as e:  # runs in the step's `finally`: never mask the step's own exception
            logger.warning(f"tapesac: cannot append {what} to {str(path)!r}: {e}")
