"""Preservation side by side on two workloads whose step writes, after the forward and before the backward, a
buffer that every block's replay reads:

* ``bank``  (sparse writes): each block attends over rows of a large memory bank gathered with index_select; the
  step then overwrites a few rows of the bank in place (index_put_), as memory-bank training does.
* ``queue`` (dense writes): each block scores against a MoCo-style queue of keys (normalized on the fly); the step
  then rotates the whole queue in place (new keys in, the oldest out).

Variants (all with policy="full", all bitwise exact — checked against a no-checkpoint step on the first round):
``keep`` (keep the activations whose replay reads the buffer), ``snapshots`` (copy the whole buffer at its first
write), ``regions`` (save the overwritten region), ``auto`` (tapesac measures the three, keeps the one with the lowest
measured peak), ``auto@limit`` (the same, then a memory limit halfway between the lowest and highest measured peaks
is set: tapesac re-chooses from its trials the fastest mode under the limit). Rounds are interleaved; step times are medians; peaks are the counted step peaks.

  python perf/bench_preserve.py --rounds 12 --out perf/results/2026-11-29_preserve_cpu.json
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import tapesac
from tapesac.bench.harness import environment


class BankBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.ff2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, bank: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        mem = bank.index_select(0, ids)  # autograd saves only ids: replay reads the bank
        a = torch.softmax(self.q(x) @ mem.t() / mem.shape[1] ** 0.5, -1)
        x = x + self.o(a @ mem)
        return x + self.ff2(F.gelu(self.ff1(x)))


class QueueBlock(BankBlock):
    def forward(self, x: torch.Tensor, queue: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # noqa: ARG002
        keys = F.normalize(queue, dim=1)  # the queue needs no grad: nothing of it is saved, replay reads it
        a = torch.softmax(self.q(x) @ keys.t() / 0.07, -1)
        x = x + self.o(a @ keys)
        return x + self.ff2(F.gelu(self.ff1(x)))


class Net(nn.Module):
    def __init__(self, kind: str, d: int, layers: int, rows: int):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.register_buffer("buf", F.normalize(torch.randn(rows, d), dim=1))
        block = BankBlock if kind == "bank" else QueueBlock
        self.layers = nn.ModuleList(block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x, self.buf, ids)
        return x


def make_step(kind: str, write_rows: int, batch: int) -> Callable[[Net, torch.Tensor, torch.Tensor, int], torch.Tensor]:
    def step(m: Net, x: torch.Tensor, ids: torch.Tensor, it: int) -> torch.Tensor:
        out = m(x, ids)
        loss = out.square().mean()
        feats = F.normalize(out.detach()[:batch], dim=1)
        with torch.no_grad():
            if kind == "bank":
                g = torch.Generator().manual_seed(it)
                rows = torch.randint(0, m.buf.shape[0], (write_rows,), generator=g)
                m.buf[rows] = feats[: write_rows % batch or batch].repeat(write_rows // batch + 1, 1)[:write_rows]
            else:
                m.buf.copy_(torch.cat([feats, m.buf[:-batch]]))  # enqueue the newest keys, drop the oldest
        loss.backward()
        return loss.detach()

    return step


def run(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    d, layers = args.hidden, args.layers
    rows = args.bank_rows if kind == "bank" else args.queue_rows
    base = Net(kind, d, layers, rows)
    x = torch.randn(args.batch, d)
    ids = torch.randperm(rows, generator=torch.Generator().manual_seed(1))[: args.gather_rows] if kind == "bank" \
        else torch.arange(0)
    step = make_step(kind, args.write_rows, args.batch)

    # Exactness (first): one step per mode against a no-checkpoint step from the same state.
    exact = {}
    for mode in ("keep", "snapshots", "regions", "auto"):
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        sac = tapesac.TapeSAC(a, blocks=a.layers, policy="full", preserve=mode)
        with sac.step():
            la = step(a, x, ids, 0)
        lb = step(b, x, ids, 0)
        exact[mode] = bool(torch.equal(la, lb) and all(torch.equal(p.grad, q.grad)
                                                      for p, q in zip(a.parameters(), b.parameters())))
        sac.close()

    models = {m: copy.deepcopy(base) for m in ("keep", "snapshots", "regions", "auto")}
    sacs = {m: tapesac.TapeSAC(models[m], blocks=models[m].layers, policy="full", preserve=m) for m in models}
    times: dict[str, list[float]] = {m: [] for m in models}
    peaks: dict[str, list[int]] = {m: [] for m in models}
    held: dict[str, list[int]] = {m: [] for m in models}
    it = 0

    def one(name: str, sac: tapesac.TapeSAC, m: Net) -> None:
        nonlocal it
        it += 1
        t0 = time.perf_counter()
        with sac.step():
            step(m, x, ids, it)
        times[name].append(time.perf_counter() - t0)
        st = sac.last_step
        peaks[name].append(st.memory.peak_bytes)
        held[name].append(sum(p["held_bytes"] for p in st.preserved))
        m.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # auto explores during these steps
        for name in models:
            one(name, sacs[name], models[name])
    for name in times:
        times[name].clear(), peaks[name].clear(), held[name].clear()
    for _ in range(args.rounds):
        for name in models:
            one(name, sacs[name], models[name])
    lo = min(min(p) for p in (peaks["keep"], peaks["snapshots"], peaks["regions"]))
    hi = max(max(p) for p in (peaks["keep"], peaks["snapshots"], peaks["regions"]))
    limit = (lo + hi) // 2
    # auto under a limit: a fresh instance explores without one, then the limit is set: tapesac chooses again from
    # its measured trials, the fastest mode under the limit.
    lim_model = copy.deepcopy(base)
    lim_sac = tapesac.TapeSAC(lim_model, blocks=lim_model.layers, policy="full", preserve="auto")
    times["auto@limit"], peaks["auto@limit"], held["auto@limit"] = [], [], []
    for _ in range(args.warmup):
        one("auto@limit", lim_sac, lim_model)
    lim_sac.memory_limit = limit
    for _ in range(2):
        one("auto@limit", lim_sac, lim_model)
    times["auto@limit"].clear(), peaks["auto@limit"].clear(), held["auto@limit"].clear()
    # Interleave with the keep variant again for a paired ratio.
    keep_again: list[float] = []
    for _ in range(args.rounds):
        one("auto@limit", lim_sac, lim_model)
        t0 = time.perf_counter()
        with sacs["keep"].step():
            step(models["keep"], x, ids, it)
        keep_again.append(time.perf_counter() - t0)
        models["keep"].zero_grad(set_to_none=True)
    res = {
        "workload": kind,
        "buffer_bytes": rows * d * 4,
        "exact": exact,
        "auto_choice": sorted(set(sacs["auto"].preservation.values())),
        "auto_trials": [t.__dict__ for t in sacs["auto"].preservation_trials],
        "auto_at_limit_choice": sorted(set(lim_sac.preservation.values())),
        "limit_bytes": limit,
        "variants": {},
    }
    for name in times:
        res["variants"][name] = {
            "step_ms_median": statistics.median(times[name]) * 1e3,
            "peak_bytes": max(peaks[name]),
            "held_bytes": max(held[name]) if held[name] else 0,
        }
    keep_ms = statistics.median(times["keep"])
    for name in ("snapshots", "regions", "auto"):
        res["variants"][name]["ratio_vs_keep"] = statistics.median(times[name]) / keep_ms
    res["variants"]["auto@limit"]["ratio_vs_keep"] = statistics.median(times["auto@limit"]) / statistics.median(keep_again)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="bank,queue")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--bank-rows", type=int, default=65536)
    ap.add_argument("--gather-rows", type=int, default=2048)
    ap.add_argument("--write-rows", type=int, default=64)
    ap.add_argument("--queue-rows", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        "environment": environment(),
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "args": vars(args),
        "workloads": [run(args, k) for k in args.workloads.split(",")],
    }
    for w in results["workloads"]:
        print(f"{w['workload']}: buffer {w['buffer_bytes'] / 2**20:.1f} MiB, exact {w['exact']}, auto chose "
              f"{w['auto_choice']}, auto@limit ({w['limit_bytes'] / 2**20:.2f} MiB) chose {w['auto_at_limit_choice']}")
        for name, v in w["variants"].items():
            print(f"  {name:11s} step {v['step_ms_median']:8.2f} ms  peak {v['peak_bytes'] / 2**20:8.2f} MiB  held "
                  f"{v['held_bytes'] / 2**20:7.3f} MiB  vs keep {v.get('ratio_vs_keep', 1.0):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
