"""policy="auto" on the test models (CPU): for limits spread between the "full" and the "none" step peaks, the
planner's predicted peak against the measured one, the replay it chooses, and the planning time.

Usage: python perf/bench_planner.py [--model qwen3|llama] [--steps 4] [--json PATH]
Each limit runs a fresh TapeSAC for --steps steps (step 1 measures under "full", then the plan applies); the
figures are those of the last step. Peaks are tapesac's counted step peaks (exact, see README); times are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import tapesac  # noqa: E402
from tapesac.bench.harness import environment  # noqa: E402
from tapesac.models import tiny_llama, tiny_qwen3  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["qwen3", "llama"], default="qwen3")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the tiny model's)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default: the tiny model's)")
    ap.add_argument("--fractions", default="0,0.25,0.5,0.75,1,1.25",
                    help="limits, as fractions of the way from full's peak to none's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    make = tiny_qwen3 if args.model == "qwen3" else tiny_llama
    torch.manual_seed(0)
    shape = {k: v for k, v in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden)) if v is not None}
    model = make(**shape)
    x = torch.randint(0, 259, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def run(sac: tapesac.TapeSAC) -> None:
        with sac.step():
            model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    ref = {}
    for policy in ("none", "full"):
        sac = tapesac.TapeSAC(model, policy=policy)
        for _ in range(2):
            run(sac)
        ref[policy] = sac.last_step
        sac.close()
    lo, hi = ref["full"].memory.peak_bytes, ref["none"].memory.peak_bytes
    rows = []
    print(f"{args.model}: step peak none {hi / 2**20:.2f} MiB, full {lo / 2**20:.2f} MiB "
          f"(full replays {ref['full'].ops_replayed} ops)")
    print(f"{'limit':>8}{'limit MiB':>11}{'predicted':>11}{'measured':>10}{'error':>8}{'kept MiB':>10}"
          f"{'ops replayed':>14}{'replay ms':>11}{'plan ms':>9}{'max step MiB':>14}")
    for frac in (float(f) for f in args.fractions.split(",")):
        limit = int(lo + frac * (hi - lo))
        sac = tapesac.TapeSAC(model, memory_limit=limit)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            run(sac)
        elapsed = time.perf_counter() - t0
        st, plan = sac.last_step, sac.plan
        err = (plan["predicted_peak_bytes"] - st.memory.peak_bytes) / st.memory.peak_bytes
        row = {"fraction": frac, "limit_bytes": limit, "predicted_peak_bytes": plan["predicted_peak_bytes"],
               "measured_peak_bytes": st.memory.peak_bytes, "prediction_error": err, "kept_bytes": st.kept_bytes,
               "ops_replayed": st.ops_replayed, "replay_ms": st.replay_ms, "planning_ms": plan["planning_ms"],
               "keeps_everything": plan["keeps_everything"],
               "max_step_peak_bytes": max(h.memory.peak_bytes for h in sac.history),
               "every_step_under_limit": all(h.memory.peak_bytes <= limit for h in sac.history),
               "plans": len(sac.plans), "seconds": elapsed, "model": plan.get("model")}
        rows.append(row)
        print(f"{frac:>8.2f}{limit / 2**20:>11.2f}{plan['predicted_peak_bytes'] / 2**20:>11.2f}"
              f"{st.memory.peak_bytes / 2**20:>10.2f}{err:>+8.3f}{st.kept_bytes / 2**20:>10.2f}{st.ops_replayed:>14}"
              f"{st.replay_ms:>11.2f}{plan['planning_ms']:>9.1f}{row['max_step_peak_bytes'] / 2**20:>14.2f}"
              f"{'' if row['every_step_under_limit'] else '  OVER THE LIMIT'}")
        sac.close()
    if args.json:
        config = {"model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps, **shape,
                  "none_peak_bytes": hi, "full_peak_bytes": lo}
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "config": config, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
