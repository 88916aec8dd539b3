# tapesac.bench — one training step of HF decoder models under every checkpointing tool, side by side.
#
# Contract:
# - `main(argv) -> int` (`python -m tapesac bench ...`, `python perf/bench_step.py ...`). Exit status 1 when a
#   required variant (the baseline and tapesac none/full/static/eager) is invalid (its loss or a gradient differs
#   from no checkpointing) or crashed. The peers (PyTorch checkpoint and SAC, torch.compile), tapesac auto and the
#   optional CUDA-graph backend are optional: their failures are findings, reported in the table and the JSON.
# - One process, one model per (architecture, size), the same input batch for every variant; variants come from
#   VARIANT_FACTORIES (read from this package when main runs: replacing the list here changes the suite), each
#   validated against no checkpointing and its peak memory measured before anything is timed; then interleaved
#   timing rounds. `--json PATH`: the environment (harness.environment) and every number; `--train-steps N`: the
#   long mode (LONG_VARIANT_FACTORIES).
#
# Where each part lives:
#   harness.py   environment and provenance, quantiles and statistics, interleaved timing rounds (also perf/*.py)
#   sizes.py     Size, SIZES, ARCHS, build_model, describe_model, model_bytes, Workload
#   variants.py  Variant, Ctx, checkpointed_blocks, the torchtitan SAC policy, the variant factories
#   measure.py   PeakMeter, run_once and compare (validation), tapesac telemetry and graph readings, jsonable
#   run.py       bench_workload: validate and measure every variant, time them, ratios (progress: ../progress.py)
#   long.py      the long mode: Trainer, LONG_VARIANT_FACTORIES, run_long
#   render.py    format_table, format_long, plot_plane, plot_long
#   cli.py       build_parser, main
from __future__ import annotations

from .cli import SCHEMA_VERSION, build_parser, main
from .harness import environment
from .long import LONG_VARIANT_FACTORIES, Trainer, run_long
from .measure import PeakMeter, Snapshot, compare, graph_launch_times
from .render import format_long, format_table, plot_long, plot_plane
from .run import bench_workload
from .sizes import ARCHS, SIZES, Size, Workload, build_model, describe_model, model_bytes
from .variants import (CKPT, NOCKPT, VARIANT_FACTORIES, Ctx, Variant, checkpointed_blocks, compile_variants,
                       nockpt_variants, pytorch_checkpoint_variants, tapesac_auto_at_sac_peak_variants,
                       tapesac_auto_variants, tapesac_backend_variants, tapesac_variants, torchtitan_context_fn)

# The name tests/python/test_graph_backend.py imports.
_graph_launch_times = graph_launch_times

__all__ = [
    "main", "build_parser", "VARIANT_FACTORIES", "LONG_VARIANT_FACTORIES", "Variant", "SIZES", "ARCHS",
    "SCHEMA_VERSION", "environment", "Trainer", "run_long", "PeakMeter", "Snapshot", "compare",
    "graph_launch_times", "format_long", "format_table", "plot_long", "plot_plane", "bench_workload", "Size",
    "Workload", "build_model", "describe_model", "model_bytes", "CKPT", "NOCKPT", "Ctx", "checkpointed_blocks",
    "compile_variants", "nockpt_variants", "pytorch_checkpoint_variants", "tapesac_auto_at_sac_peak_variants",
    "tapesac_auto_variants", "tapesac_backend_variants", "tapesac_variants", "torchtitan_context_fn",
]
