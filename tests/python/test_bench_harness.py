"""The shared perf harness (tapesac.bench.harness): provenance, statistics, interleaved rounds.

- Provenance (Note [Provenance]): the git commit is recorded only when the package directory is tracked source of
  a git checkout of tapesac; a package in another project's repository, in an untracked folder of a tapesac
  checkout (a virtual environment inside it), or outside any repository records the package version and no
  commit, whatever repository the current directory is in.
- stats / quantile / paired_ratio on known samples; interleaved_rounds rotates the order, discards the warm-up
  rounds, and drops a variant that raises.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import tapesac
from tapesac.bench import harness

requires_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def _repo(root: Path, project: str, package: str = "python/tapesac", ignore: str = "") -> tuple[Path, str]:
    """A git repository at `root` whose pyproject.toml names `project`, with a committed package folder; returns
    (the package folder, the commit)."""
    pkg = root / package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0.0"\n')
    (root / "pyproject.toml").write_text(f'[build-system]\nrequires = []\n\n[project]\nname = "{project}"\n'
                                         'version = "9.9.9"\n')
    if ignore:
        (root / ".gitignore").write_text(ignore + "\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "init")
    return pkg, _git(root, "rev-parse", "HEAD")


@requires_git
def test_provenance_of_a_tapesac_checkout_is_its_commit(tmp_path, monkeypatch):
    pkg, commit = _repo(tmp_path / "tapesac", "tapesac")
    other, _ = _repo(tmp_path / "elsewhere", "elsewhere")
    monkeypatch.chdir(other)  # the current directory's repository must not matter
    got = harness.provenance(pkg)
    assert got["git_commit"] == commit, got
    assert got["git_dirty"] is False, got
    assert got["tapesac_source"] == f"git checkout {(tmp_path / 'tapesac').resolve()}", got
    assert got["tapesac_version"] == tapesac.__version__
    (pkg / "__init__.py").write_text('__version__ = "0.0.1"\n')
    assert harness.provenance(pkg)["git_dirty"] is True


@requires_git
def test_provenance_outside_a_tapesac_checkout_is_the_version(tmp_path, monkeypatch):
    cases = {}
    cases["another project's repository"], _ = _repo(tmp_path / "other", "not-tapesac")
    # A virtual environment inside a tapesac checkout: the installed copy is not the checkout's source.
    _repo(tmp_path / "checkout", "tapesac", ignore=".venv/")
    venv_pkg = tmp_path / "checkout" / ".venv" / "lib" / "site-packages" / "tapesac"
    venv_pkg.mkdir(parents=True)
    (venv_pkg / "__init__.py").write_text("")
    cases["an ignored folder of a tapesac checkout"] = venv_pkg
    plain = tmp_path / "site-packages" / "tapesac"
    plain.mkdir(parents=True)
    (plain / "__init__.py").write_text("")
    cases["no repository"] = plain
    tapesac_repo, _ = _repo(tmp_path / "cwd", "tapesac")
    monkeypatch.chdir(tapesac_repo)  # even from inside a tapesac checkout
    for what, pkg in cases.items():
        got = harness.provenance(pkg)
        assert got["git_commit"] is None and got["git_dirty"] is None, (what, got)
        assert got["tapesac_version"] == tapesac.__version__, (what, got)
        assert got["tapesac_source"] == f"installed package {pkg}", (what, got)


def test_environment_records_the_imported_package():
    env = harness.environment()
    pkg = Path(tapesac.__file__).resolve().parent
    assert env["tapesac_version"] == tapesac.__version__
    if env["git_commit"] is None:  # the usual case: `make build` installs the package into site-packages
        assert env["tapesac_source"] == f"installed package {pkg}", env
    else:  # the package runs from its checkout (in-place build, editable install)
        root = Path(env["tapesac_source"].removeprefix("git checkout "))
        assert pkg.is_relative_to(root) and (root / "pyproject.toml").is_file(), env
    for key in ("date", "torch", "cuda_build", "device", "cpu_count", "threads", "python", "platform"):
        assert key in env, f"environment lacks {key!r}: {sorted(env)}"


def test_stats_and_quantiles():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert harness.quantile(xs, 0.0) == 1.0 and harness.quantile(xs, 1.0) == 4.0
    assert harness.quantile(xs, 0.25) == pytest.approx(1.75)  # numpy's linear interpolation
    assert harness.quantile([7.0], 0.9) == 7.0
    s = harness.stats(xs, scale=1e3)
    assert s == pytest.approx({"median": 2500.0, "q1": 1750.0, "q3": 3250.0, "iqr": 1500.0, "min": 1000.0,
                               "max": 4000.0, "n": 4})
    assert s["n"] == 4 and isinstance(s["n"], int)
    assert harness.paired_ratio([2.0, 6.0, 4.0], [1.0, 2.0, 4.0]) == 2.0


def test_interleaved_rounds_rotate_discard_warmup_and_drop_failures():
    calls: list[tuple[int, str]] = []
    seen_round = [0]
    errors: dict[str, str] = {}
    kept: list[str] = []

    def sample(name: str) -> float:
        calls.append((seen_round[0], name))
        if name == "c" and seen_round[0] == 2:
            raise RuntimeError("broken")
        return float(seen_round[0])

    def before(name: str, r: int) -> None:
        seen_round[0] = r

    times = harness.interleaved_rounds(["a", "b", "c"], sample, rounds=3, warmup=1, before=before,
                                       after=kept.append, on_error=lambda n, e: errors.setdefault(n, str(e)))
    orders = {r: [n for rr, n in calls if rr == r] for r in range(4)}
    assert orders == {0: ["a", "b", "c"], 1: ["b", "c", "a"], 2: ["c", "a", "b"], 3: ["b", "a"]}, orders
    assert times == {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.0, 3.0], "c": [1.0]}, times
    assert errors == {"c": "broken"} and kept.count("c") == 1 and kept.count("a") == 3
    with pytest.raises(RuntimeError, match="broken"):
        harness.interleaved_rounds(["a", "b", "c"], sample, rounds=3, warmup=1, before=before)
