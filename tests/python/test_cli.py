"""The command line (tapesac.cli): argparse subcommands, --version, the `tapesac` console script, validate, one-line
user errors (a traceback only with --debug), progress on stderr, report without matplotlib, the demo's corpus
warning on stderr, and one median step in demo and report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

TINY_DEMO = ["--steps", "3", "--layers", "1", "--hidden", "32", "--batch", "1", "--seq", "16", "--val-batches", "1"]


def _cli():
    from tapesac import cli

    return cli


def test_version_and_console_script(tapesac, capsys) -> None:
    with pytest.raises(SystemExit):  # argparse's own --version exits; main() turns it into a status
        _cli().build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"tapesac {tapesac.__version__}"
    assert _cli().main(["--version"]) == 0
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="console_scripts") if e.name == "tapesac"]
    assert eps and eps[0].value == "tapesac.cli:main", eps
    script = shutil.which("tapesac", path=os.path.dirname(sys.executable))
    assert script, "the tapesac console script is not installed beside this interpreter"
    r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"tapesac {tapesac.__version__}", (r.stdout, r.stderr)
    r = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and all(c in r.stdout for c in ("demo", "validate", "report", "frontier", "bench"))


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tapesac, capsys) -> None:
    cli = _cli()
    assert cli.main(["demo", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tapesac demo: error: --steps must be >= 1, got 0", err
    # A memory limit below the floor: MemoryLimitError from the planner, one line naming the smallest feasible limit.
    assert cli.main(["demo", *TINY_DEMO, "--no-check", "--policy", "auto", "--memory-limit", "1KiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tapesac demo: error: ") and "Traceback" not in err[0], err
    with pytest.raises(tapesac.TapeSACError):
        cli.main(["demo", *TINY_DEMO, "--no-check", "--policy", "auto", "--memory-limit", "1KiB", "--debug"])
    assert cli.main(["report", "/nonexistent/log.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a file" in err[0], err
    assert cli.main(["nonsense"]) == 2  # argparse: usage and the error on stderr
    assert "invalid choice" in capsys.readouterr().err


def test_validate_command(tapesac, capsys, tmp_path) -> None:
    out_json = tmp_path / "v.json"
    assert _cli().main(["validate", "--model", "qwen3_moe", "--size", "smoke", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal" in out and "NOT" not in out, out
    data = json.loads(out_json.read_text())
    assert data["bitwise_equal"] is True and data["gradients"]


def test_demo_output_paths_are_checked_before_training(tapesac, capsys, tmp_path) -> None:
    """--json naming a folder failed after the whole run with a raw OSError; --json and --log naming one file let the
    results overwrite the telemetry (adversarial tests). Both are usage errors now, before any work."""
    cli = _cli()
    assert cli.main(["demo", "--steps", "1000000", "--json", str(tmp_path)]) == 2  # refused before a million steps
    assert "--json must be a file path" in capsys.readouterr().err
    same = str(tmp_path / "d.jsonl")
    assert cli.main(["demo", "--steps", "1000000", "--json", same, "--log", same]) == 2
    assert "name one file" in capsys.readouterr().err
    assert not (tmp_path / "d.jsonl").exists()


def test_validate_auto_says_it_checked_full(tapesac, capsys) -> None:
    """validate runs one step; auto's first measures with full's masks. The output said only "bitwise equal", read as
    a check of auto's plans (an adversarial test): it now says what was checked."""
    assert _cli().main(["validate", "--size", "smoke", "--policy", "auto", "--memory-limit", "1.3MiB"]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal" in out and 'this checked "full", no plan of auto' in out, out


def test_report_without_matplotlib(tapesac, tmp_path) -> None:
    """`report` needs matplotlib only for --plot; without it --plot is a one-line error naming the extra."""
    from models import stack, x_in
    from conftest import default_loss

    log = tmp_path / "log.jsonl"
    model = stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", log=log)
    for _ in range(2):
        with sac.step():
            default_loss(model, (x_in(),)).backward()
    sac.close()
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tapesac import cli\n"
            "sys.exit(cli.main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "report", str(log)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "step peak" in r.stdout, r.stderr
    assert not list(tmp_path.glob("*.png"))
    png = tmp_path / "out.png"
    r = subprocess.run([sys.executable, "-c", code, "report", str(log), "--plot", str(png)], capture_output=True,
                       text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "tapesac[plot]" in err[0], r.stderr
    assert not png.exists()


def test_demo_corpus_warning_goes_to_stderr(tapesac, capsys, monkeypatch) -> None:
    import tapesac.data as data

    monkeypatch.setattr(data, "_repo_roots", lambda: [])
    monkeypatch.setenv(data.CORPUS_ENV, "/nonexistent/austen")
    rc = _cli().main(["demo", *TINY_DEMO, "--steps", "1"])
    out, err = capsys.readouterr()
    assert "the Austen corpus was not found" in err and "the Austen corpus was not found" not in out
    assert "shared/data/README.md" not in err and "Project Gutenberg" in err
    assert rc == (0 if os.path.isdir(data.LICENSES_DIR) else 2)


def test_demo_and_report_print_the_same_median_step(tapesac, capsys, tmp_path) -> None:
    log, out_json, rep_json = tmp_path / "d.jsonl", tmp_path / "d.json", tmp_path / "r.json"
    assert _cli().main(["demo", *TINY_DEMO, "--log", str(log), "--json", str(out_json)]) == 0
    assert _cli().main(["report", str(log), "--json", str(rep_json)]) == 0
    demo = json.loads(out_json.read_text())
    (report,) = json.loads(rep_json.read_text())
    assert demo["median_step_ms"] == report["median_step_ms"] == demo["report"]["median_step_ms"]
    steps = [s["forward_backward_ms"] for s in demo["steps"]]
    import statistics

    assert demo["median_step_ms"] == statistics.median(steps[1:])  # steps 2..: step 1 is the warm-up
    out = capsys.readouterr().out
    assert f"median step {demo['median_step_ms']:.1f} ms" in out


def test_progress_goes_to_stderr_through_tqdm(tapesac, capsys) -> None:
    from tapesac.progress import Progress

    p = Progress(enabled=True, every=3600.0, label="bench")
    p("first", force=True)
    p("second")  # within `every` of the first: not printed (not a terminal)
    p.done()
    Progress(enabled=False)("nothing", force=True)
    out, err = capsys.readouterr()
    assert out == "" and "] first" in err and "second" not in err and "nothing" not in err


@pytest.mark.parametrize("argv", [
    ["demo", "--batch", "0"], ["demo", "--seq", "0"], ["demo", "--hidden", "0"], ["demo", "--heads", "0"],
    ["demo", "--heads", "5"], ["demo", "--lr", "nan"], ["demo", "--lr", "-1"], ["demo", "--val-batches", "-1"],
    ["demo", "--layers", "0"], ["demo", "--seq", "1"], ["frontier", "--rounds", "0"], ["frontier", "--points", "1"],
    # Output paths, checked before the job (a long run ended in an untyped OSError / ValueError, exit 1).
    ["demo", "--plot", "/nonexistent/m.png"], ["demo", "--plot", "m.notaformat"], ["frontier", "--plot", "."],
    ["frontier", "--json", "/nonexistent/f.json"], ["validate", "--json", "/nonexistent/v.json"],
    ["report", "--plot", "r.notaformat", "log.jsonl"], ["report", "--plot", "", "log.jsonl"],
    ["report", "--json", "/nonexistent/r.json", "log.jsonl"],
], ids=lambda a: "_".join(a).replace("--", "").replace("/", "")[:40])
def test_bad_option_values_are_one_line_usage_errors(tapesac, capsys, argv) -> None:
    """Found by an adversarial test: these failed deep in the job and exited 1 as "internal error ... report it"
    (a ZeroDivisionError for --heads 0, AdamW's ValueError for --lr nan). Now one line naming the option, exit 2,
    before anything is built."""
    assert _cli().main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tapesac {argv[0]}: error: {argv[1]}"), err


def test_validate_with_a_limit_below_the_floor_is_a_usage_error(tapesac, capsys) -> None:
    """A limit below the floor is the caller's to fix, not an exactness verdict: it printed "NOT bitwise equal" with
    every gradient differing and exited 1 (found by an adversarial test). Now MemoryLimitError's one line, exit 2."""
    assert _cli().main(["validate", "--policy", "auto", "--memory-limit", "1KiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tapesac validate: error: tapesac: memory_limit"), err
    assert "smallest feasible" in err[0]
