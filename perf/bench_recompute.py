"""Counts recompute exactly: ops and FLOPs that backward runs beyond a no-checkpoint backward.

Runs the same tiny HF Qwen3 model and batch three ways — no checkpointing, ``torch.utils.checkpoint``
(non-reentrant, per decoder layer) and tapesac ``policy="full"`` — checks that loss and every gradient are bitwise
equal to the no-checkpoint run, and counts, with a ``TorchDispatchMode`` and ``FlopCounterMode`` active during
``loss.backward()``, the ops and FLOPs each backward executes. Recompute = count − count(no checkpoint).

    python perf/bench_recompute.py [--layers 4] [--hidden 128] [--seq 64] [--batch 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import sys
from contextlib import nullcontext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import tapesac  # noqa: E402
from tapesac.bench import checkpointed_blocks  # noqa: E402
from tapesac.bench.harness import environment  # noqa: E402


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def build(layers: int, hidden: int) -> torch.nn.Module:
    from tapesac.models import tiny_qwen3

    return tiny_qwen3(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, seed=0)


def run(model: torch.nn.Module, ids: torch.Tensor, mode: str):
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full") if mode == "tapesac" else None
    ops, flops = OpCounter(), FlopCounterMode(display=False)
    torch.manual_seed(1)
    if sac is not None:
        with sac.step():
            loss = model(input_ids=ids, labels=ids).loss
            with flops, ops:
                loss.backward()
    else:
        # checkpoint: every decoder layer's forward runs under torch.utils.checkpoint (non-reentrant) while open.
        region = checkpointed_blocks(list(model.model.layers)) if mode == "checkpoint" else nullcontext()
        with region:
            loss = model(input_ids=ids, labels=ids).loss
            with flops, ops:
                loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, ops.counts, flops.get_total_flops()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args(argv)
    base = build(args.layers, args.hidden)
    base.train()
    ids = torch.randint(0, 259, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))
    results = {}
    for mode in ("none", "checkpoint", "tapesac"):
        results[mode] = run(copy.deepcopy(base), ids, mode)
    ref_loss, ref_grads, ref_ops, ref_flops = results["none"]
    out = {"environment": environment(), "model": f"Qwen3 tiny L{args.layers} H{args.hidden}", "batch": args.batch,
           "seq": args.seq}
    print(f"{out['model']}, batch {args.batch} x seq {args.seq}: recompute during backward (beyond no checkpointing)")
    print(f"{'variant':<12}{'exact':>7}{'recompute ops':>15}{'recompute GFLOP':>17}")
    for mode in ("checkpoint", "tapesac"):
        loss, grads, ops, flops = results[mode]
        exact = torch.equal(loss, ref_loss) and all(
            (grads[n] is None) == (g is None) and (g is None or torch.equal(grads[n], g)) for n, g in ref_grads.items()
        )
        extra_ops = sum(ops.values()) - sum(ref_ops.values())
        extra = {k: ops[k] - ref_ops.get(k, 0) for k in ops if ops[k] != ref_ops.get(k, 0)}
        out[mode] = {"exact": exact, "recompute_ops": extra_ops, "recompute_flops": flops - ref_flops,
                     "recompute_ops_by_name": extra}
        print(f"{mode:<12}{str(exact):>7}{extra_ops:>15}{(flops - ref_flops) / 1e9:>17.4f}")
    for mode in ("checkpoint", "tapesac"):
        top = sorted(out[mode]["recompute_ops_by_name"].items(), key=lambda kv: -kv[1])
        print(f"  {mode}: " + ", ".join(f"{k} {v}" for k, v in top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    ok = out["checkpoint"]["exact"] and out["tapesac"]["exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
