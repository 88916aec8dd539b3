# tapesac.bench.harness — what every benchmark shares: the environment record, summary statistics, interleaved
# timing rounds. Used by the bench package and by every perf/*.py script.
#
# Contract:
# - `environment() -> dict`: when and where a run happened (date, Python, torch, transformers, CUDA, device, CPU,
#   threads, platform) and which tapesac ran (`provenance()`). No field is read at import.
# - `provenance(package_dir=None) -> dict`: `tapesac_version` (the package's __version__), `tapesac_source`
#   ("git checkout <top>" or "installed package <dir>"), `git_commit` and `git_dirty`, which are the checkout's only
#   when the package runs from a git checkout of tapesac (see Note [Provenance]) and None otherwise.
# - `quantile(xs, p)`, `stats(xs, scale=1.0)` {median, q1, q3, iqr, min, max, n}, `paired_ratio(xs, ys)`: plain
#   functions of the samples; `stats` multiplies every figure but `n` by `scale` (seconds -> ms: 1e3).
# - `interleaved_rounds(names, sample, rounds=, warmup=)`: `warmup` discarded rounds, then `rounds` kept rounds;
#   every round samples each live name once, in an order that rotates by one each round; gc is collected before
#   and between rounds and disabled while sampling (restored on exit). `timed(fn, inner=1, sync=None)`: seconds per
#   call of `fn` over `inner` calls.
#
# Note [Provenance]
# A result is only comparable later if it says which code produced it. The git commit is that answer only when the
# imported package *is* the checkout's source: the package directory is a folder git tracks in a repository whose
# top level holds this project's pyproject.toml ([project] name = "tapesac"). An installed package (site-packages,
# the usual `make build`) has no commit of its own; the repository around the current directory, or around a
# virtual environment that happens to sit inside some checkout, says nothing about it. Then the package version is
# recorded instead, and git_commit / git_dirty are None.
from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

__all__ = ["environment", "provenance", "quantile", "stats", "paired_ratio", "interleaved_rounds", "timed"]


def _git(cwd: Path, *args: str) -> str | None:
    """stdout of `git -C cwd args...`, stripped; None when git is missing or the command fails."""
    try:
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _project_name(pyproject: Path) -> str | None:
    """[project] name of a pyproject.toml, None when the file is missing or has none."""
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the [project] table's name line
        table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        name = re.search(r"^name\s*=\s*[\"']([^\"']+)[\"']", table.group(1), re.M) if table else None
        return name.group(1) if name else None
    try:
        name = tomllib.loads(text).get("project", {}).get("name")
    except tomllib.TOMLDecodeError:
        return None
    return name if isinstance(name, str) else None


def _checkout_of(package_dir: Path) -> Path | None:
    """The top level of the tapesac git checkout whose tracked source `package_dir` is, else None (Note
    [Provenance])."""
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    if not top:
        return None
    root = Path(top)
    if _project_name(root / "pyproject.toml") != "tapesac":
        return None
    tracked = _git(root, "ls-files", "--", str(package_dir.resolve() / "__init__.py"))
    return root if tracked else None


def provenance(package_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Which tapesac this is: the checkout's commit when `package_dir` (default: the imported tapesac package) is the
    source of a git checkout of tapesac, else the package version only. See Note [Provenance]."""
    from .. import __version__

    pkg = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parents[1]
    root = _checkout_of(pkg)
    if root is None:
        return {"tapesac_version": __version__, "tapesac_source": f"installed package {pkg}", "git_commit": None,
                "git_dirty": None}
    status = _git(root, "status", "--porcelain")
    return {"tapesac_version": __version__, "tapesac_source": f"git checkout {root}",
            "git_commit": _git(root, "rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None}


def _cpu_model() -> str | None:
    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def environment() -> dict[str, Any]:
    """The environment record every benchmark's JSON carries (date, versions, device, CPU, threads, provenance)."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    cpu = _cpu_model()
    cuda = torch.cuda.is_available()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **provenance(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu: {cpu}",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def describe_provenance(env: dict[str, Any]) -> str:
    """One phrase for a banner line: "git 0123456789 (dirty)" or "tapesac 0.1.0 (installed package)"."""
    if env.get("git_commit"):
        return f"git {env['git_commit'][:10]}{' (dirty)' if env.get('git_dirty') else ''}"
    return f"tapesac {env.get('tapesac_version')} (installed package)"


def quantile(xs: Iterable[float], p: float) -> float:
    """The p-quantile of xs, linear between the two nearest ranks (numpy's default)."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = p * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(xs: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """{median, q1, q3, iqr, min, max, n} of xs; every figure but n multiplied by `scale`."""
    q1, q3 = quantile(xs, 0.25), quantile(xs, 0.75)
    out = {"median": statistics.median(xs), "q1": q1, "q3": q3, "iqr": q3 - q1, "min": min(xs), "max": max(xs)}
    return {**{k: v * scale for k, v in out.items()}, "n": len(xs)}


def paired_ratio(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Median over rounds of xs[i] / ys[i]: samples taken in the same round share its load, so the ratio is robust
    to slowdowns of the whole machine that come and go."""
    return statistics.median(x / y for x, y in zip(xs, ys))


def timed(fn: Callable[[], Any], inner: int = 1, sync: Callable[[], None] | None = None) -> float:
    """Seconds per call of `fn`, over `inner` calls (then `sync()`, e.g. torch.cuda.synchronize, inside the clock)."""
    t0 = time.perf_counter_ns()
    for _ in range(inner):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter_ns() - t0) / inner * 1e-9


def interleaved_rounds(names: Sequence[str], sample: Callable[[str], float], *, rounds: int, warmup: int = 0,
                       before: Callable[[str, int], None] | None = None,
                       after: Callable[[str], None] | None = None,
                       on_error: Callable[[str, Exception], None] | None = None) -> dict[str, list[float]]:
    """Per name, the samples of `rounds` timed rounds after `warmup` discarded ones.

    Each round calls `sample(name)` (seconds) once per name still live, starting one further along every round, so
    each name takes each position equally often. `before(name, r)` runs before every sample (r counts warm-up
    rounds from 0); `after(name)` after every kept sample (for readings beside the time). A sample that raises
    drops its name from the later rounds: `on_error(name, exc)` is told (its earlier samples stay in the result);
    without `on_error` the exception propagates. gc: collected before the first round and after each round,
    disabled while sampling, restored on exit.
    """
    times: dict[str, list[float]] = {n: [] for n in names}
    live = list(names)
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(warmup + rounds):
            k = r % max(1, len(live))
            for name in live[k:] + live[:k]:
                if before is not None:
                    before(name, r)
                try:
                    t = sample(name)
                except Exception as e:
                    if on_error is None:
                        raise
                    live.remove(name)
                    on_error(name, e)
                    continue
                if r >= warmup:
                    times[name].append(t)
                    if after is not None:
                        after(name)
            if gc_was:
                gc.collect()  # outside the samples
    finally:
        if gc_was:
            gc.enable()
    return times
