#!/usr/bin/env python3
# perf/bench_step.py — the side-by-side training-step benchmark (issue 8); the same as `python -m tapesac bench`
# (see python/tapesac/bench/ and perf/README.md). Run `make build` first so the installed package is this tree.
#
#     HF_HUB_OFFLINE=1 python perf/bench_step.py --smoke
#     python perf/bench_step.py --size small --json perf/results/$(date +%F)_bench_step_small_cpu.json --plot ...
from __future__ import annotations

import sys

from tapesac.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
