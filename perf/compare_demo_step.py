"""Side-by-side step time on the demo model (Qwen3 H192 L4, batch 8 x seq 128): no checkpointing,
torch.utils.checkpoint per layer (non-reentrant), tapesac policy "none" and "full"; forward + backward, 25
interleaved rounds. Kept for the README figure it produced; it is now one configuration of perf/bench_step.py
(the tapesac.bench package), which also validates every variant and measures peak memory. Extra options are
passed on (e.g. --json PATH, --rounds N).

    python perf/compare_demo_step.py
"""
import sys

from tapesac.bench import main

if __name__ == "__main__":
    sys.exit(main(["--size", "demo", "--models", "qwen3", "--rounds", "25", "--warmup", "3",
                   "--variants", "nockpt,ckpt,tapesac_none,tapesac_full", *sys.argv[1:]]))
