"""The benchmark suite's smoke mode runs end to end and writes a complete, self-consistent JSON.

`tapesac.bench.main(["--smoke", "--json", path])` (tiny Qwen3, Qwen3-MoE and Llama, 3 timed rounds, ~15 s on the
2-core CPU machine): every variant the suite knows is present, each either timed (positive numbers, consistent
ratios, validated against no checkpointing) or carrying the reason it was not; tapesac's own modes are bitwise
exact. A short long-mode run (--train-steps 3 on Austen) checks the training report the same way.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

import tapesac

STATUSES = {"ok", "invalid", "error", "unavailable", "skipped"}
# Required: fail the suite when not "ok". The peers and tapesac features not built yet may report a reason instead.
REQUIRED = ("nockpt", "tapesac_none", "tapesac_full", "tapesac_ops", "tapesac_eager")
ALWAYS = ("nockpt", "ckpt", "torch_sac", "compile_b0.5", "tapesac_none", "tapesac_full", "tapesac_ops",
          "tapesac_eager", "tapesac_cuda_graph")
# The side-by-side variants perf/gpu_check.sh benchmarks on the GPU (perf/gpu_figures.py suite, with auto at half).
GPU_CHECK_VARIANTS = ("nockpt", "ckpt", "torch_sac", "tapesac_eager", "tapesac_cuda_graph")


def _bench():
    from tapesac import bench

    return bench


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "smoke.json"
    rc = _bench().main(["--smoke", "--json", str(path), "--quiet"])
    return rc, json.loads(path.read_text())


def test_smoke_exit_status_and_environment(smoke):
    rc, report = smoke
    assert rc == 0, "bench --smoke failed: a required variant is invalid or crashed (see its stderr)"
    env = report["environment"]
    for key in ("git_commit", "torch", "cuda_build", "device", "cpu_count", "date", "threads"):
        assert key in env, f"environment lacks {key!r}: {sorted(env)}"
    assert report["schema_version"] == 1
    assert report["memory_method"], "the JSON must say how peak memory was measured"
    assert {w["model"] for w in report["workloads"]} == {"qwen3", "qwen3_moe", "llama"}


def test_smoke_every_variant_present_with_numbers_or_reason(smoke):
    _, report = smoke
    for w in report["workloads"]:
        variants = w["variants"]
        missing = [n for n in ALWAYS if n not in variants]
        assert not missing, f"{w['name']}: variants missing from the JSON: {missing}"
        assert any(n.startswith("tapesac_auto") for n in variants), f"{w['name']}: no tapesac auto entry"
        for name, r in variants.items():
            where = f"{w['name']}/{name}"
            assert r["status"] in STATUSES, f"{where}: unknown status {r['status']!r}"
            if r["status"] != "ok":
                assert r.get("reason"), f"{where}: status {r['status']} without a reason"
                assert "step_ms" not in r, f"{where}: a variant that is not ok must not be timed"
                continue
            assert r["validation"]["valid"] is True, f"{where}: timed but not validated: {r['validation']}"
            t = r["step_ms"]
            assert t["n"] >= 1 and 0 < t["min"] <= t["median"] <= t["max"], f"{where}: bad step times {t}"
            assert t["q1"] <= t["median"] <= t["q3"], f"{where}: quartiles {t}"
            assert r["peak_bytes"] > 0, f"{where}: peak memory {r['peak_bytes']}"
            for key in ("time_ratio_nockpt", "time_ratio_ckpt", "peak_ratio_nockpt", "peak_ratio_ckpt"):
                assert r[key] > 0 and math.isfinite(r[key]), f"{where}: {key}={r.get(key)}"
            assert r["recompute_method"], f"{where}: recompute time without its method"
            if name.startswith("tapesac_auto_"):
                assert isinstance(r["within_limit"], bool), f"{where}: auto without the peak-vs-limit check"
        for name in REQUIRED:
            r = variants[name]
            assert r["status"] == "ok", f"{w['name']}/{name}: {r['status']}: {r.get('reason')}"
            if name != "nockpt":
                assert r["validation"]["method"] == "bitwise", f"{w['name']}/{name}: {r['validation']}"
                assert r["recompute_method"].startswith("measured"), r["recompute_method"]
        # tapesac's own rows never crash: a limit tapesac declines on the workload (its auto limits) is skipped with
        # the reason, not an ERROR row (Qwen3-MoE's smoke size is such a workload).
        for name, r in variants.items():
            if name.startswith("tapesac_"):
                assert r["status"] != "error", f"{w['name']}/{name}: {r.get('reason')}"


def test_smoke_ratios_consistent(smoke):
    _, report = smoke
    for w in report["workloads"]:
        v = w["variants"]
        base, ckpt = v["nockpt"], v["ckpt"]
        assert base["time_ratio_nockpt"] == 1.0 and base["peak_ratio_nockpt"] == 1.0
        if ckpt["status"] == "ok":
            assert ckpt["time_ratio_ckpt"] == 1.0 and ckpt["peak_ratio_ckpt"] == 1.0
            assert ckpt["block_forwards_per_step"] == 2 * w["blocks"], "checkpoint did not recompute each block"
        for name, r in v.items():
            if r["status"] != "ok":
                continue
            where = f"{w['name']}/{name}"
            assert r["peak_ratio_nockpt"] == pytest.approx(r["peak_bytes"] / base["peak_bytes"], rel=1e-12), where
            assert r["time_ratio_nockpt_of_medians"] == pytest.approx(
                r["step_ms"]["median"] / base["step_ms"]["median"], rel=1e-9), where
            if ckpt["status"] == "ok":
                assert r["peak_ratio_ckpt"] == pytest.approx(r["peak_bytes"] / ckpt["peak_bytes"], rel=1e-12), where
            if not r["recompute_method"].startswith("measured") and name != "nockpt":
                assert r["recompute_ms"] == pytest.approx(r["step_ms"]["median"] - base["step_ms"]["median"],
                                                          rel=1e-9, abs=1e-9), where
        # tapesac "full" keeps only what replay cannot rebuild: it must not hold more than "none" at the peak.
        assert v["tapesac_full"]["peak_bytes"] <= v["tapesac_none"]["peak_bytes"], w["name"]


def test_long_mode_short_run(tmp_path):
    from tapesac.data import find_corpus

    if find_corpus() is None:
        pytest.skip("the Austen corpus (../shared/data/austen) is not on this machine")
    path = tmp_path / "long.json"
    rc = _bench().main(["--train-steps", "3", "--train-size", "smoke", "--json", str(path), "--quiet",
                        "--train-plot", str(tmp_path / "long.png")])
    assert rc == 0
    long = json.loads(path.read_text())["long"]
    assert long["steps"] == 3 and set(long["runs"]) >= {"nockpt", "ckpt"}
    assert any(n.startswith("tapesac") for n in long["runs"]), long["runs"].keys()
    for name, r in long["runs"].items():
        assert len(r["loss"]) == 3 and len(r["step_s"]) == 3 and r["total_s"] > 0, name
        assert r["total_s"] == pytest.approx(sum(r["step_s"])), name
        # Every run is exact, so on CPU all loss curves are the same numbers.
        assert r["losses_bitwise_equal_to_nockpt"] is True, f"{name}: loss curve differs from no checkpointing"
        assert statistics.fmean(r["loss"]) > 0
    assert (tmp_path / "long.png").stat().st_size > 0


def test_invalid_variant_is_reported_and_not_timed(tmp_path, monkeypatch):
    """A variant whose gradients differ from no checkpointing is INVALID, never timed, and fails the run."""
    bench = _bench()

    def wrong(ctx):
        def step():
            loss = ctx.work.loss() * 1.5  # scaled loss: every gradient is wrong
            loss.backward()
            return loss

        return [bench.Variant(name="wrong", label="loss x 1.5", kind="tapesac", step=step)]

    monkeypatch.setattr(bench, "VARIANT_FACTORIES", [bench.nockpt_variants, wrong])
    path = tmp_path / "invalid.json"
    rc = bench.main(["--smoke", "--models", "qwen3", "--json", str(path), "--quiet"])
    assert rc == 1, "an invalid required variant must fail the run"
    r = json.loads(path.read_text())["workloads"][0]["variants"]["wrong"]
    assert r["status"] == "invalid" and "not bitwise equal" in r["reason"], r
    assert "step_ms" not in r and "peak_bytes" not in r, "an invalid variant must not be timed or measured"


def test_smoke_backend_variants_on_cpu(smoke):
    """tapesac_eager runs (bitwise, backend "eager"); tapesac_cuda_graph is skipped with the reason on CPU."""
    _, report = smoke
    for w in report["workloads"]:
        eager, graph = w["variants"]["tapesac_eager"], w["variants"]["tapesac_cuda_graph"]
        assert eager["status"] == "ok" and eager["tapesac"]["backend"] == "eager", (w["name"], eager)
        assert eager["info"]["policy"] == "full" and eager["info"]["backend"] == "eager", eager["info"]
        assert graph["status"] == "skipped" and "needs a CUDA workload" in graph["reason"], (w["name"], graph)


def _gpu_figures_suite_variants() -> list[str]:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "perf" / "gpu_figures.py"
    spec = importlib.util.spec_from_file_location("gpu_figures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SUITE_VARIANTS.split(",")


def test_gpu_check_variant_list_runs_exactly_those(tmp_path):
    """perf/gpu_check.sh runs perf/gpu_figures.py's suite; its variant list is the five side-by-side variants plus
    auto at half, parses, and selects exactly those (on CPU the graph variant is skipped, not crashed)."""
    script = (Path(__file__).resolve().parents[2] / "perf" / "gpu_check.sh").read_text()
    assert "perf/gpu_figures.py" in script and '"${FIG[0]}" suite' in script, "gpu_check.sh no longer runs the suite"
    variants = _gpu_figures_suite_variants()
    assert set(GPU_CHECK_VARIANTS) <= set(variants), f"the GPU suite lost side-by-side variants: {variants}"
    path = tmp_path / "gpu_check_variants.json"
    rc = _bench().main(["--smoke", "--models", "qwen3", "--rounds", "1", "--warmup", "0", "--quiet",
                        "--variants", ",".join(variants), "--auto-fractions", "0.5", "--json", str(path)])
    assert rc == 0
    w = json.loads(path.read_text())["workloads"][0]
    assert sorted(w["variants"]) == sorted(variants), sorted(w["variants"])
    assert w["unknown_variants"] == []
    for name in ("nockpt", "ckpt", "torch_sac", "tapesac_eager"):
        assert w["variants"][name]["status"] == "ok", (name, w["variants"][name])
        assert w["variants"][name]["step_ms"]["n"] == 1
    assert w["variants"]["tapesac_cuda_graph"]["status"] == "skipped"


def test_misspelt_variant_fails_the_run_before_anything_runs(tmp_path, capsys):
    """A misspelt --variants name fails at once, naming the known ones: no model is built, no variant is run (it
    used to fail only after the whole suite had run)."""
    path = tmp_path / "typo.json"
    rc = _bench().main(["--smoke", "--rounds", "1", "--warmup", "0", "--quiet",
                        "--variants", "nockpt,tapesac_egaer,tapesac_auto_0.3", "--json", str(path)])
    assert rc == 1, "a --variants name that matches no variant must fail the run"
    report = json.loads(path.read_text())
    assert report["workloads"] == [], "nothing may run when a --variants name is unknown"
    # tapesac_auto_0.3 is not made under the default --auto-fractions (0.25,0.5,0.75).
    assert report["unknown_variants"] == ["tapesac_auto_0.3", "tapesac_egaer"]
    assert {"tapesac_eager", "tapesac_auto_0.25", "compile_b0.5"} <= set(report["known_variants"])
    err = capsys.readouterr().err
    assert "tapesac_egaer" in err and "--auto-fractions" in err, err


def test_unknown_variants_under_replaced_factories_are_reported_per_workload(tmp_path, monkeypatch):
    """With the factory list replaced (tests, extensions) the names are known only once the factories ran: the
    workload's record reports the unknown ones and the run fails."""
    bench = _bench()
    monkeypatch.setattr(bench, "VARIANT_FACTORIES", [bench.nockpt_variants, bench.pytorch_checkpoint_variants])
    path = tmp_path / "typo.json"
    rc = bench.main(["--smoke", "--models", "qwen3", "--rounds", "1", "--warmup", "0", "--quiet",
                     "--variants", "nockpt,ckpt,tapesac_full", "--json", str(path)])
    assert rc == 1
    w = json.loads(path.read_text())["workloads"][0]
    assert w["unknown_variants"] == ["tapesac_full"] and "ckpt" in w["known_variants"], w


def test_the_catalogue_of_names_covers_every_variant_the_suite_made(smoke):
    """variants.variant_names() (what --variants is checked against up front) lists every variant the default suite
    made in the smoke run, placeholders included (run.bench_workload also asserts it while it makes them)."""
    from tapesac.bench.cli import build_parser
    from tapesac.bench.variants import variant_names

    _, report = smoke
    known = variant_names(build_parser().parse_args(["--smoke"]))
    for w in report["workloads"]:
        assert set(w["variants"]) <= known, (w["name"], sorted(set(w["variants"]) - known))


def test_a_factory_making_an_uncatalogued_name_fails_the_suite(tmp_path, monkeypatch, capsys):
    """The catalogue cannot drift from the factories: a name variant_names() lacks stops the run at once."""
    from tapesac.bench import run, variants

    monkeypatch.setattr(run, "variant_names", lambda args: variants.variant_names(args) - {"tapesac_ops"})
    rc = _bench().main(["--smoke", "--models", "qwen3", "--rounds", "1", "--warmup", "0", "--quiet",
                        "--json", str(tmp_path / "x.json")])
    assert rc != 0
    assert "tapesac_variants made variant 'tapesac_ops'" in capsys.readouterr().err
