"""Step time with the write watcher (preserve="auto", the default) against without it (preserve="off"): tiny HF
Qwen3, policy "full", one thread, interleaved rounds, medians after warm-up. The watcher is a thread-local
dispatcher callback from the first block's forward until the backward starts.

  python perf/bench_watch_overhead.py --rounds 25
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tapesac
from tapesac.models import tiny_qwen3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_qwen3(seed=0)
    x = torch.randint(0, 259, (8, 128), generator=torch.Generator().manual_seed(0))
    sacs = {mode: tapesac.TapeSAC(model, blocks="model.layers.*", policy="full", preserve=mode)
            for mode in ("off", "auto")}
    times: dict[str, list[float]] = {k: [] for k in sacs}
    for r in range(args.warmup + args.rounds):
        order = list(sacs.items()) if r % 2 == 0 else list(reversed(sacs.items()))  # no position bias
        for mode, sac in order:
            t0 = time.perf_counter()
            with sac.step():
                model(input_ids=x, labels=x).loss.backward()
            model.zero_grad(set_to_none=True)
            if r >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = [a / b for a, b in zip(times["auto"], times["off"])]
    print(f"step ms: preserve=off {med['off']:.2f}, preserve=auto {med['auto']:.2f}; "
          f"median per-round ratio auto/off {statistics.median(ratios):.4f}")


if __name__ == "__main__":
    main()
