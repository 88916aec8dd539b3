"""Step time with the write watcher (preserve="auto", the default) against without it (preserve="off"): tiny HF
Qwen3, policy "full", one thread, interleaved rounds, medians after warm-up. The watcher is a thread-local
dispatcher callback from the first block's forward until the backward starts.

  python perf/bench_watch_overhead.py --rounds 25
"""
from __future__ import annotations

import argparse
import statistics

import torch

import tapesac
from tapesac.bench import harness
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

    def step(mode: str) -> None:
        with sacs[mode].step():
            model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    # The order alternates each round (no position bias).
    times = harness.interleaved_rounds(list(sacs), lambda m: harness.timed(lambda: step(m)), rounds=args.rounds,
                                       warmup=args.warmup)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"step ms: preserve=off {med['off']:.2f}, preserve=auto {med['auto']:.2f}; "
          f"median per-round ratio auto/off {harness.paired_ratio(times['auto'], times['off']):.4f}")


if __name__ == "__main__":
    main()
