"""Graphs and the planner under one memory limit, on CPU through the emulated graph device: tiny HF Qwen3 (4x128
tokens), policy "auto" at limits between the "full" peak and the no-checkpoint peak, eager vs emulated_graph.
Per limit: kept tensors, graph replays, fallback reasons, the reserve the plan left for graphs and the measured
peak of the last step (exact counts from the counting allocator; no timing).

  python perf/graph_limit_cpu.py --fractions 0.3 0.7 1.0 --steps 4
"""
from __future__ import annotations

import argparse
import json

import torch

import tapesac
from tapesac.bench.harness import environment
from tapesac.models import tiny_qwen3


def run(backend: str, policy: str, x: torch.Tensor, limit: int | None = None, steps: int = 1) -> dict:
    torch.manual_seed(0)
    model = tiny_qwen3()
    sac = tapesac.TapeSAC(model, policy=policy, memory_limit=limit, backend=backend)
    try:
        for _ in range(steps):
            with sac.step():
                model(input_ids=x, labels=x).loss.backward()
            model.zero_grad(set_to_none=True)
        st = sac.last_step
        return {"backend": backend, "limit_bytes": limit, "peak_bytes": st.memory.peak_bytes,
                "kept_tensors": st.kept_tensors, "replays": st.replays, "graph_replays": st.graph_replays,
                "graph_fallbacks": st.graph_fallback_reasons,
                "graph_reserve_bytes": (sac.plan or {}).get("graph_reserve_bytes", 0),
                "graph_static_bytes": sac._session.graph_static_bytes}
    finally:
        sac.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.7, 1.0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randint(0, 259, (4, 128), generator=torch.Generator().manual_seed(0))
    none = run("eager", "none", x)["peak_bytes"]
    full = run("eager", "full", x)["peak_bytes"]
    rows = []
    print(f"full peak {full} B, no-checkpoint peak {none} B")
    print(f"{'fraction':>8} {'backend':>15} {'limit MB':>9} {'peak MB':>8} {'kept':>5} {'graph/replays':>13} "
          f"{'reserve MB':>10}  fallbacks")
    for frac in args.fractions:
        limit = int(full + frac * (none - full))
        for backend in ("eager", "emulated_graph"):
            r = run(backend, "auto", x, limit, args.steps)
            r["fraction"] = frac
            rows.append(r)
            print(f"{frac:>8.2f} {backend:>15} {limit / 1e6:>9.2f} {r['peak_bytes'] / 1e6:>8.2f} "
                  f"{r['kept_tensors']:>5} {r['graph_replays']:>6}/{r['replays']:<6} "
                  f"{r['graph_reserve_bytes'] / 1e6:>10.2f}  {r['graph_fallbacks'] or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "full_peak_bytes": full, "none_peak_bytes": none,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
