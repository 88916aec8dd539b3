"""Approximate rematerialization study: a small Llama trained from scratch on Austen, exact replay vs approx.

What it runs: for every seed, one training run per configuration — exact replay (policy "full"), and
tapesac.Approx(fraction, method, targets) for each target set x fraction x method — same initial weights, same batches
(the seed fixes both), AdamW with a linear warm-up and a cosine decay to 0 (--schedule), a fixed number of steps. fraction=1 runs once (sketch, every target): at fraction 1 the
approximate path is not taken at all (approx.h), so every method and target gives the exact run, bitwise; the study
checks that its validation loss equals exact's.
What it records per run: validation perplexity on persuasion.txt (held out, tapesac.data.AustenData), the train loss
curve (every 10 steps), median step time, units recomputed (telemetry); per configuration once: the recompute FLOPs
of one step's backward (FlopCounterMode; backward with tapesac minus the same backward without checkpointing).
The recompute FLOPs count matmuls (FlopCounterMode) and the CPU flash SDPA kernel (4*b*h*s*t*d, registered here).
Output: --out JSON, rewritten after every run (a partial study survives an interruption), and a table on stdout.

  python perf/approx_study.py --steps 300 --seeds 0 1 2 --out perf/results/2026-11-29_approx_study_cpu.json
  python perf/approx_study.py --smoke       # 3 steps, 2 configurations: checks the script runs
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import tapesac  # noqa: E402
from tapesac.bench.harness import environment  # noqa: E402
from tapesac.data import AustenData  # noqa: E402
from tapesac.models import param_count, tiny_llama  # noqa: E402

TARGETS = {"mlp": ("mlp",), "attn": ("attn",), "both": ("mlp", "attn")}


def configs(targets: list[str], fractions: list[float], methods: list[str]) -> list[dict]:
    out = [dict(name="exact", approx=None)]
    if 1.0 in fractions:
        out.append(dict(name="f=1 (all targets)", approx=dict(fraction=1.0, method="sketch",
                                                              targets=sorted({t for k in targets for t in TARGETS[k]}))))
    for t in targets:
        for f in fractions:
            if f == 1.0:
                continue
            for m in methods:
                out.append(dict(name=f"{t} f={f:.3g} {m}", target=t, fraction=f, method=m,
                                approx=dict(fraction=f, method=m, targets=list(TARGETS[t]))))
    return out


def build(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    return tiny_llama(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, seed=seed)


def make_sac(model: torch.nn.Module, cfg: dict, seed: int) -> tapesac.TapeSAC:
    approx = None
    if cfg["approx"] is not None:
        a = cfg["approx"]
        approx = tapesac.Approx(fraction=a["fraction"], method=a["method"], targets=tuple(a["targets"]), seed=seed)
    return tapesac.TapeSAC(model, blocks="model.layers.*", policy="full", approx=approx)


@torch.no_grad()
def validate(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    model.eval()
    losses = [float(model(input_ids=b, labels=b).loss) for b in batches]
    model.train()
    return sum(losses) / len(losses)


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """The CPU flash SDPA kernel (no formula in FlopCounterMode): QK^T and PV, 2*b*h*s*t*d FLOPs each."""
    b, h, s, d = query_shape
    return 4 * b * h * s * key_shape[2] * d


def recompute_flops(args: argparse.Namespace, cfg: dict, batch: torch.Tensor) -> dict:
    """FLOPs of one backward with tapesac minus the same backward without checkpointing (same weights, batch)."""

    def backward_flops(model: torch.nn.Module, sac: tapesac.TapeSAC | None) -> tuple[int, dict]:
        ctx = sac.step() if sac is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            loss = model(input_ids=batch, labels=batch).loss
            mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops}
            with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
                loss.backward()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        per_op = {str(k): int(v) for k, v in fc.get_flop_counts().get("Global", {}).items()}
        return fc.get_total_flops(), per_op

    base_model = build(args, 0)
    plain, _ = backward_flops(copy.deepcopy(base_model), None)
    model = copy.deepcopy(base_model)
    sac = make_sac(model, cfg, 0)
    with_sac, per_op = backward_flops(model, sac)
    st = sac.last_step
    sac.close()
    return dict(recompute_flops=with_sac - plain, backward_flops_no_checkpoint=plain, recompute_flops_by_op=per_op,
                units_recomputed=st.approx_units_recomputed, units_total=st.approx_units_total,
                heads_recomputed=st.approx_heads_recomputed, heads_total=st.approx_heads_total,
                kept_bytes=st.kept_bytes, dropped_bytes=st.dropped_bytes)


def train(args: argparse.Namespace, cfg: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    model = build(args, seed)
    data = AustenData(seq_len=args.seq, batch_size=args.batch, seed=seed)
    val = data.val_batches(args.val_batches)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    def lr_at(s: int) -> float:
        if s < args.warmup:
            return (s + 1) / args.warmup
        if args.schedule == "constant":
            return 1.0
        # Cosine to 0 at the last step: the final weights sit at the end of a decay, not at a random point of a noisy
        # trajectory, so that validation perplexity compares across configurations.
        return 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / max(1, args.steps - args.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    sac = make_sac(model, cfg, seed)
    # --exact-warmup N: the first N steps replay exactly (a second TapeSAC without approx), then approx.
    warm = make_sac(model, dict(approx=None), seed) if args.exact_warmup and cfg["approx"] is not None else None
    times, curve = [], []
    it = iter(data)
    start = time.perf_counter()
    for step in range(args.steps):
        batch = next(it)
        t0 = time.perf_counter()
        if warm is not None and step == args.exact_warmup:
            warm.close()
            warm = None
        with (warm or sac).step():
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        times.append(time.perf_counter() - t0)
        if step % 10 == 0 or step == args.steps - 1:
            curve.append((step, float(loss.detach())))
    wall = time.perf_counter() - start
    st = sac.last_step
    sac.close()
    val_loss = validate(model, val)
    return dict(seed=seed, val_loss=val_loss, val_ppl=math.exp(val_loss), train_curve=curve,
                median_step_ms=1e3 * statistics.median(times[min(5, len(times) - 1):]), wall_s=wall,
                units_recomputed=st.approx_units_recomputed, units_total=st.approx_units_total,
                heads_recomputed=st.approx_heads_recomputed, heads_total=st.approx_heads_total,
                peak_bytes=st.memory.peak_bytes if st.memory else 0, kept_bytes=st.kept_bytes,
                dropped_bytes=st.dropped_bytes, ops_replayed=st.ops_replayed)


def summarize(results: list[dict]) -> list[dict]:
    exact = {r["seed"]: r for r in results if r["config"] == "exact"}
    rows = []
    names = list(dict.fromkeys(r["config"] for r in results))
    for name in names:
        runs = [r for r in results if r["config"] == name]
        ppl = [r["val_ppl"] for r in runs]
        deltas = [100 * (r["val_ppl"] / exact[r["seed"]]["val_ppl"] - 1) for r in runs if r["seed"] in exact]
        rows.append(dict(
            config=name, seeds=len(runs), val_ppl_mean=statistics.mean(ppl),
            val_ppl_std=statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
            delta_pct_mean=statistics.mean(deltas) if deltas else None,
            delta_pct_std=statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
            delta_pct_min=min(deltas) if deltas else None, delta_pct_max=max(deltas) if deltas else None,
            median_step_ms=statistics.median(r["median_step_ms"] for r in runs),
            recompute_flops=runs[0].get("recompute_flops"),
            units=f"{runs[0]['units_recomputed']}/{runs[0]['units_total']}",
            heads=f"{runs[0]['heads_recomputed']}/{runs[0]['heads_total']}",
            kept_bytes=runs[0]["kept_bytes"], peak_bytes=statistics.median(r["peak_bytes"] for r in runs),
        ))
    exact_flops = next((r["recompute_flops"] for r in rows if r["config"] == "exact"), None)
    for r in rows:
        r["recompute_flops_vs_exact"] = (r["recompute_flops"] / exact_flops) if exact_flops else None
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'config':<22}{'val ppl':>16}{'Δ vs exact %':>20}{'recompute GFLOP':>17}{'× exact':>9}"
             f"{'step ms':>9}{'units':>11}{'heads':>7}{'kept MiB':>9}"]
    for r in rows:
        d = "" if r["delta_pct_mean"] is None else f"{r['delta_pct_mean']:+.2f} ± {r['delta_pct_std']:.2f}"
        fl = "" if r["recompute_flops"] is None else f"{r['recompute_flops'] / 1e9:.3f}"
        ratio = "" if r["recompute_flops_vs_exact"] is None else f"{r['recompute_flops_vs_exact']:.3f}"
        lines.append(f"{r['config']:<22}{r['val_ppl_mean']:>9.3f} ± {r['val_ppl_std']:.3f}{d:>20}{fl:>17}{ratio:>9}"
                     f"{r['median_step_ms']:>9.1f}{r['units']:>11}{r['heads']:>7}{r['kept_bytes'] / 2**20:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", nargs="+", default=["mlp", "attn", "both"], choices=sorted(TARGETS))
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 2 / 3, 1 / 2])
    p.add_argument("--methods", nargs="+", default=["greedy", "sketch"], choices=["greedy", "sketch"])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="learning rate after the linear warm-up: cosine decay to 0 at the last step, or constant")
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--exact-warmup", type=int, default=0,
                   help="approximate configurations replay exactly for their first N steps (then approx)")
    p.add_argument("--only", nargs="*", default=None, help="run only the configurations with these names")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="3 steps, seed 0, exact and one approx configuration")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.steps, args.seeds, args.val_batches = 3, [0], 2
        args.targets, args.fractions, args.methods = ["mlp"], [0.5], ["sketch"]
    cfgs = configs(args.targets, args.fractions, args.methods)
    if args.only:
        cfgs = [c for c in cfgs if c["name"] in args.only]
    probe = AustenData(seq_len=args.seq, batch_size=args.batch, seed=0)
    batch = probe.sample()
    flops = {c["name"]: recompute_flops(args, c, batch) for c in cfgs}
    model_info = dict(arch="tiny_llama", hidden=args.hidden, layers=args.layers, heads=args.heads,
                      kv_heads=args.kv_heads, intermediate=build(args, 0).config.intermediate_size,
                      params=param_count(build(args, 0)), seq=args.seq, batch=args.batch)
    print(f"model {model_info}; data {probe.describe()}", flush=True)
    results = []
    t_start = time.perf_counter()
    for seed in args.seeds:
        for c in cfgs:
            r = train(args, c, seed)
            r.update(config=c["name"], approx=c["approx"], **{k: v for k, v in flops[c["name"]].items()
                                                               if k not in ("units_recomputed", "units_total",
                                                                            "heads_recomputed", "heads_total",
                                                                            "kept_bytes", "dropped_bytes")})
            results.append(r)
            print(f"[{time.perf_counter() - t_start:7.0f}s] seed {seed} {c['name']:<22} val ppl {r['val_ppl']:.3f} "
                  f"step {r['median_step_ms']:.1f} ms units {r['units_recomputed']}/{r['units_total']} heads "
                  f"{r['heads_recomputed']}/{r['heads_total']}", flush=True)
            if args.out is not None:
                rows = summarize(results)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(dict(
                    schema_version=1, kind="approx_study", environment=environment(), model=model_info,
                    args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    flops=flops, summary=rows, runs=results), indent=1) + "\n")
    rows = summarize(results)
    print(table(rows))
    f1 = [r for r in results if r["config"].startswith("f=1")]
    exact = {r["seed"]: r for r in results if r["config"] == "exact"}
    for r in f1:
        same = r["val_loss"] == exact.get(r["seed"], {}).get("val_loss")
        print(f"fraction 1, seed {r['seed']}: validation loss {'bitwise equal to' if same else 'DIFFERS from'} exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
