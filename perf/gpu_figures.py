# perf/gpu_figures.py — the figures of the GPU check (perf/gpu_check.sh), merged into one JSON file.
#
# Contract:
# - `python perf/gpu_figures.py PART --json PATH [--cpu]`; PART is one of
#     suite    HF Qwen3 ~1B (size gpu1b, bf16, seq 4096, batch 1) through `tapesac bench`'s suite in this process:
#              nockpt, torch.utils.checkpoint, PyTorch SAC, tapesac full eager, tapesac full cuda_graph, tapesac auto
#              at the halfway limit — each validated against nockpt before it is timed; step time and step peak;
#     compile  the same workload: nockpt and torch.compile with activation_memory_budget=0.5 (a part of its own, so
#              the check's stage limit bounds the compilation: no figure when it does not compile in time);
#     extras   (1) a launch-bound decoder (small hidden size, many layers, short sequence): tapesac full with
#              backend="cuda_graph" against backend="eager", both validated against no checkpointing, replay time per
#              step (StepStats.replay_ms, median over the steps after priming); (2) the per-op times of the graph
#              launches CUPTI timed and the op-time source of the planner (policy="auto") on the same model;
#              (3) the forward alone of the ~1B model under sac.step() (policy "full") against a plain forward.
# - The JSON file holds one key per part that ran ({"suite": ..., "compile": ..., "extras": ...}) plus
#   "environment"; a part rewrites only its key (the file is read first), so the parts can run as separate
#   processes under separate time limits and still leave one file.
# - --cpu: the rehearsal on a machine without a GPU: the bench's CPU size "small", a tiny launch-bound model, the
#   emulated graph backend instead of cuda_graph, one round — the same code paths up to the device.
# - Exit status: 0 when the part ran (figures may still say "skipped" or "invalid" with the reason), 1 when it
#   raised (the traceback is printed and the part's key holds the error).
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

SUITE_VARIANTS = "nockpt,ckpt,torch_sac,tapesac_eager,tapesac_cuda_graph,tapesac_auto_0.5"


def _bench_args(cpu: bool, variants: str, compile_: bool) -> list[str]:
    size = ["--size", "small", "--rounds", "1", "--warmup", "0"] if cpu else \
        ["--size", "gpu1b", "--batch", "1", "--rounds", "2", "--warmup", "1"]
    extra = (["--compile", "--compile-budgets", "0.5"] if compile_ else ["--no-compile"])
    return ["--models", "qwen3", *size, "--variants", variants, "--auto-fractions", "0.5", "--quiet", *extra]


def part_suite(cpu: bool) -> dict[str, Any]:
    from tapesac.bench.cli import build_parser, run_suite

    status, report = run_suite(build_parser().parse_args(_bench_args(cpu, SUITE_VARIANTS, compile_=False)), echo=True)
    return {"status": status, "workloads": report.get("workloads", []), "memory_method": report.get("memory_method")}


def part_compile(cpu: bool) -> dict[str, Any]:
    from tapesac.bench.cli import build_parser, run_suite

    status, report = run_suite(build_parser().parse_args(_bench_args(cpu, "nockpt,compile_b0.5", compile_=True)),
                               echo=True)
    return {"status": status, "workloads": report.get("workloads", [])}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _snapshot(model: torch.nn.Module, loss: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _max_rel_diff(a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]) -> float:
    worst = abs(a[0] - b[0]) / max(abs(b[0]), 1e-12)
    for n, g in b[1].items():
        h = a[1][n]
        worst = max(worst, float((h - g).abs().max()) / max(float(g.abs().max()), 1e-12))
    return worst


def _launch_bound(cpu: bool) -> tuple[Callable[[], torch.nn.Module], torch.Tensor, str]:
    from tapesac import models

    device = "cpu" if cpu else "cuda"
    layers, hidden, seq = (6, 64, 16) if cpu else (48, 256, 128)

    def make() -> torch.nn.Module:
        m = models.tiny_qwen3(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=2 * hidden, seed=0)
        return m.to(device)

    ids = torch.randint(0, models.BYTE_VOCAB_SIZE, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return make, ids, f"tiny Qwen3: {layers} layers, hidden {hidden}, seq {seq}, fp32, batch 1, {device}"


def _tapesac_run(tapesac: Any, make: Callable[[], torch.nn.Module], ids: torch.Tensor, steps: int,
                 **kwargs: Any) -> dict[str, Any]:
    device = ids.device.type
    model = make()
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", **kwargs)
    replay_ms, step_ms, snap = [], [], None
    try:
        for s in range(steps):
            torch.manual_seed(0)
            _sync(device)
            t0 = time.perf_counter()
            with sac.step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            _sync(device)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            st = sac.last_step
            if s >= 2:  # steps 1-2 prime (warm-up replay, capture)
                replay_ms.append(st.replay_ms)
            if s == steps - 1:
                snap = _snapshot(model, loss)
            else:
                model.zero_grad(set_to_none=True)
        st = sac.last_step
        from tapesac.bench.measure import graph_launch_times

        out = {"backend": sac.backend, "replay_ms_median": statistics.median(replay_ms) if replay_ms else None,
               "step_ms_median": statistics.median(step_ms[2:]) if len(step_ms) > 2 else None,
               "graph_replays_last_step": sum(b.graph_replays for b in st.blocks),
               "graph_fallbacks_last_step": sorted({b.graph_fallback for b in st.blocks} - {""}),
               "op_timing": st.op_timing,
               "op_timing_notes": sorted({b.op_timing_note for b in st.blocks} - {""}),
               "graph_launch_times": graph_launch_times(sac.history)}
        return {"figures": out, "snapshot": snap}
    finally:
        sac.close()


def part_extras(cpu: bool) -> dict[str, Any]:
    import tapesac

    out: dict[str, Any] = {}
    make, ids, what = _launch_bound(cpu)
    graph_backend = "emulated_graph" if cpu else "cuda_graph"
    # (1) launch-bound: validated against no checkpointing first.
    model = make()
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = _snapshot(model, loss)
    steps = 3 if cpu else 8
    runs = {}
    for backend in ("eager", graph_backend):
        r = _tapesac_run(tapesac, make, ids, steps, policy="full", backend=backend, graph_timing="first")
        r["figures"]["max_rel_diff_vs_nockpt"] = _max_rel_diff(r["snapshot"], ref)
        r["figures"]["valid"] = r["figures"]["max_rel_diff_vs_nockpt"] <= 1e-4
        runs[backend] = r["figures"]
    e, g = runs["eager"]["replay_ms_median"], runs[graph_backend]["replay_ms_median"]
    out["launch_bound"] = {"model": what, "runs": runs,
                           "graph_replay_speedup": (e / g) if e and g else None, "goal_speedup": 1.3}
    # (2) the planner's op costs: policy="auto" under a roomy limit; op_timing says where the costs came from.
    r = _tapesac_run(tapesac, make, ids, 3, policy="auto", memory_limit="90%", backend=graph_backend)
    out["planner_op_costs"] = {"op_timing": r["figures"]["op_timing"], "notes": r["figures"]["op_timing_notes"]}
    # (3) the forward alone of the ~1B model (the CPU rehearsal: the bench's "small" size), plain vs sac.step().
    from tapesac.bench.sizes import SIZES, build_model

    size = SIZES["small" if cpu else "gpu1b"]
    big = build_model("qwen3", size, seed=0)
    seq = 64 if cpu else size.seq
    ids1 = torch.randint(0, big.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(2)).to(size.device)
    sac = tapesac.TapeSAC(big, blocks="model.layers.*", policy="full", backend="eager")
    times: dict[str, list[float]] = {"plain": [], "tapesac_full": []}
    try:
        for r_ in range(2 if cpu else 4):
            for name in ("plain", "tapesac_full"):
                ctx = sac.step() if name == "tapesac_full" else _null()
                with ctx:
                    _sync(size.device)
                    t0 = time.perf_counter()
                    loss = big(input_ids=ids1, labels=ids1).loss
                    _sync(size.device)
                    if r_ > 0:
                        times[name].append((time.perf_counter() - t0) * 1e3)
                    loss.backward()
                big.zero_grad(set_to_none=True)
    finally:
        sac.close()
    fwd = {k: statistics.median(v) for k, v in times.items() if v}
    out["forward_alone"] = {"model": f"{'small' if cpu else 'gpu1b'}/qwen3, batch 1, seq {seq}", "ms": fwd,
                            "ratio": fwd["tapesac_full"] / fwd["plain"] if fwd.get("plain") else None}
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


PARTS = {"suite": part_suite, "compile": part_compile, "extras": part_extras}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--json", required=True, type=Path)
    p.add_argument("--cpu", action="store_true", help="the CPU rehearsal (small sizes, emulated graph backend)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_figures: no CUDA device; pass --cpu for the rehearsal", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        result, rc = PARTS[args.part](args.cpu), 0
    except Exception as e:  # the part's key says what broke; the other parts keep theirs
        traceback.print_exc()
        result, rc = {"error": f"{type(e).__name__}: {e}"}, 1
    result["seconds"] = round(time.perf_counter() - t0, 1)
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    data["environment"] = environment()
    data[args.part] = result
    from tapesac.bench.measure import jsonable

    args.json.write_text(json.dumps(jsonable(data), indent=1))
    print(f"gpu_figures {args.part}: rc={rc} in {result['seconds']} s -> {args.json}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
