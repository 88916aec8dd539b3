"""Overhead of tapesac's memory telemetry on the demo model (CPU), as a ratio from one interleaved run.

Two comparisons, each A/B interleaved over --rounds rounds (order alternating) after warm-up, medians reported:
  1. the counting allocator layer: a plain training step (no tapesac) inside a MemoryMeter vs without;
  0. per allocation: 20,000 torch.empty(256) + free in a loop, plain vs inside a MemoryMeter (ns per pair), and
     the number of allocations one demo step makes (so that the per-step cost follows without timing noise);
  2. the step timeline: a tapesac step (policy "full") recording its memory timeline (8192 points, one per
     allocation and free until decimated) vs the same step with the timeline off (counters still on).
Usage: python perf/bench_telemetry.py [--rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import tapesac  # noqa: E402
from tapesac import _C  # noqa: E402
from tapesac.bench import harness  # noqa: E402
from tapesac.models import tiny_qwen3  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = tiny_qwen3()
    x = torch.randint(0, 259, (args.batch, args.seq))

    def plain() -> None:
        model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    def metered() -> None:
        with tapesac.MemoryMeter():
            plain()

    sac = tapesac.TapeSAC(model, policy="full")

    def with_telemetry() -> None:
        with sac.step():
            model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    # The same step with the session's timeline disabled (the counters still count).
    sac_off = tapesac.TapeSAC(model, policy="full")
    sac_off._session = _C.Session("full", None, True, True, False, timeline_points=0)

    def without_timeline() -> None:
        with sac_off.step():
            model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    def alloc_loop(n: int = 20000) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            t = torch.empty(256)
            del t
        return (time.perf_counter() - t0) / n * 1e9

    a, b = [], []
    for _ in range(10):
        a.append(alloc_loop())
        with tapesac.MemoryMeter():
            b.append(alloc_loop())
    per_alloc = statistics.median(b) - statistics.median(a)
    with tapesac.MemoryMeter() as m:
        plain()
    allocs = m.allocations
    print(f"per allocation+free: plain {statistics.median(a):.0f} ns, counted {statistics.median(b):.0f} ns "
          f"(+{per_alloc:.0f} ns); one plain step makes {allocs} allocations -> {per_alloc * allocs / 1e6:.3f} ms")
    results = {"per_alloc_ns": {"plain": statistics.median(a), "counted": statistics.median(b),
                                "extra": per_alloc}, "allocations_per_step": allocs}

    pairs = {"allocator layer (plain step)": (plain, metered),
             "step timeline (tapesac full)": (without_timeline, with_telemetry)}
    for name, (a, b) in pairs.items():
        fns = {"without": a, "with": b}
        t = harness.interleaved_rounds(list(fns), lambda n: harness.timed(fns[n]), rounds=args.rounds, warmup=3)
        ma, mb = statistics.median(t["without"]), statistics.median(t["with"])
        results[name] = {"baseline_ms": ma * 1e3, "with_ms": mb * 1e3, "ratio": mb / ma}
        if name.startswith("allocator"):
            results["per_step_cost_fraction"] = per_alloc * allocs / 1e9 / ma
        print(f"{name:<32} without {ma * 1e3:8.2f} ms   with {mb * 1e3:8.2f} ms   ratio {mb / ma:.4f}")
        if name.startswith("allocator"):
            print(f"  per-allocation cost x allocations / step time = {results['per_step_cost_fraction']:.4%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": harness.environment(), "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
