"""Issue 19's promise, measured: with a memory_limit between tapesac's floor and torch.utils.checkpoint's step peak,
every step of policy "full" (planned replay schedules, the default) and of policy "auto" stays within the limit, or
is flagged over it (StepStats.over_limit) — never silently over.

Usage: python perf/bench_limits.py [--sizes small,medium] [--models qwen3,llama,qwen3_moe] [--steps 6]
       [--fractions 0.25,0.5,0.75] [--policies full,auto] [--json PATH]

Per (size, model): checkpointing's step peak and the floor — the step peak of "full" with schedule="lazy" (the
least any replay schedule holds) — are measured first; then each policy runs --steps training steps (same batch,
gradients cleared) under each limit `floor + fraction x (ckpt peak - floor)` from a fresh TapeSAC. Reported per run:
the limit, every step's peak, the steps over it and whether each was flagged, and a MemoryLimitError if one was
raised (its message names the smallest feasible limit). Peaks are tapesac's counted step peaks (exact, CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import tapesac  # noqa: E402
from tapesac.bench.harness import environment  # noqa: E402
from tapesac.bench.sizes import SIZES, build_model  # noqa: E402

MiB = 2**20


def _ids(model: torch.nn.Module, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)  # [batch, seq]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def ckpt_peak(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """torch.utils.checkpoint (non-reentrant) around every decoder layer: the step peak (MemoryMeter)."""
    layers = model.model.layers
    prior = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = lambda *a, _f=layer.forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    try:
        peaks = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with tapesac.MemoryMeter() as m:
                _loss(model, ids).backward()
            resident = itertools.chain(model.parameters(), model.buffers())
            peaks.append(m.peak_bytes + sum(t.numel() * t.element_size() for t in resident))
        return max(peaks)
    finally:
        for layer, fwd in zip(layers, prior):  # as before: assigning the bound forward back made a reference cycle
            if fwd is None:
                del layer.forward
            else:
                layer.forward = fwd
        model.zero_grad(set_to_none=True)


def run(model: torch.nn.Module, ids: torch.Tensor, steps: int, **kw: Any) -> dict[str, Any]:
    """`steps` steps under TapeSAC(**kw) from a fresh instance; every step's peak and flag, or the error."""
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", **kw)
    out: dict[str, Any] = {"peaks": [], "flagged": [], "error": None}
    try:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            with sac.step():
                _loss(model, ids).backward()
            out["peaks"].append(sac.last_step.memory.peak_bytes)
            out["flagged"].append(bool(sac.last_step.over_limit))
    except tapesac.MemoryLimitError as e:
        out["error"] = str(e)
    finally:
        sac.close()
        model.zero_grad(set_to_none=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--models", default="qwen3,llama,qwen3_moe")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fractions", default="0.25,0.5,0.75")
    ap.add_argument("--policies", default="full,auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    fractions = [float(f) for f in args.fractions.split(",")]
    results: list[dict[str, Any]] = []
    silent = 0
    for size_name in args.sizes.split(","):
        size = SIZES[size_name]
        for arch in args.models.split(","):
            model = build_model(arch, size, seed=0)
            ids = _ids(model, size.batch, size.seq)
            ckpt = ckpt_peak(model, ids)
            floor = max(run(model, ids, 2, policy="full", schedule="lazy")["peaks"])
            print(f"{size_name}/{arch}: ckpt peak {ckpt / MiB:.2f} MiB, floor (full, lazy) {floor / MiB:.2f} MiB "
                  f"({floor / ckpt:.3f} x ckpt)", flush=True)
            for policy in args.policies.split(","):
                for frac in fractions:
                    limit = int(floor + frac * (ckpt - floor))
                    kw: dict[str, Any] = {"policy": policy, "memory_limit": limit}
                    if policy == "auto":
                        kw["schedule"] = "planned"  # below the one-segment floor auto needs planned schedules
                    r = run(model, ids, args.steps, **kw)
                    over = [i + 1 for i, p in enumerate(r["peaks"]) if p > limit]
                    unflagged = [i for i in over if not r["flagged"][i - 1]]
                    silent += len(unflagged)
                    rec = {"size": size_name, "model": arch, "policy": policy, "fraction": frac, "limit": limit,
                           "ckpt_peak": ckpt, "floor": floor, **r, "over_steps": over, "unflagged_over": unflagged}
                    results.append(rec)
                    err = f"  MemoryLimitError: {r['error'][:160]}" if r["error"] else ""
                    print(f"  {policy:5s} limit {limit / MiB:8.2f} MiB ({limit / ckpt:.3f} x ckpt): peaks "
                          f"{[round(p / limit, 3) for p in r['peaks']]} x limit; over at steps {over} "
                          f"(unflagged {unflagged}){err}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema_version": 1, "benchmark": "bench_limits", "environment": environment(),
                       "args": vars(args), "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    print(f"silent over-limit steps: {silent}")
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
