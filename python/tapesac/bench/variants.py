# tapesac.bench.variants — the ways to run one training step that the suite compares, made by factories.
#
# Contract:
# - A factory is `Ctx -> list[Variant]`; VARIANT_FACTORIES lists the suite's, called in order. Each returns
#   runnable Variants, or placeholders (status "unavailable" / "skipped" with the reason). A factory runs after
#   the variants before it were validated and measured, so it can read their numbers in `ctx.results` (tapesac
#   auto's limits come from the measured peaks of ckpt and nockpt).
# - The eager variants share the workload's model: each installs itself around its own step only (patched block
#   forwards in `checkpointed_blocks`, or tapesac's `with sac.step()`); torch.compile gets a deep copy of the
#   pristine model. Required variants (the baseline, tapesac none/full/static/eager) have optional=False; the peers
#   and tapesac auto and cuda_graph are optional: their failures are findings, never fatal.
# - `checkpointed_blocks(blocks, counter, context_fn)`: torch.utils.checkpoint (non-reentrant) around each block's
#   forward while open; `torchtitan_context_fn()`: PyTorch SAC with a torchtitan-style policy.
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .sizes import MiB, Workload

NOCKPT, CKPT = "nockpt", "ckpt"
# tapesac_full_planned_bNN: planned schedules under a replay time budget of NN% (Config.schedule_budget).
SCHEDULE_BUDGETS_PCT = (0, 5, 10, 20, 40)


@dataclass
class Variant:
    """One way to run a training step.

    name: key in the results ("tapesac_full"); label: what the table prints.
    kind: "baseline" | "pytorch" | "compile" | "tapesac".
    step: runs forward + backward once and returns the loss (None for a placeholder).
    model: the module whose parameters get the gradients (the workload's model unless the variant has a copy).
    status: "" for a runnable variant, else "unavailable" or "skipped" with `reason`.
    exact: compared bitwise on CPU (else within measure.COMPILE_RTOL of the model's dtype).
    optional: an invalid result or a crash is reported but does not fail the run (peer tools, tapesac auto and the
        optional CUDA-graph backend); required variants (the baseline, tapesac's exact modes) fail it.
    block_forwards: expected block-forward calls per step (2 x layers for whole-block recompute), or None.
    counter: incremented by the variant on each block forward it sees (checkpoint variants).
    sac: the TapeSAC object of a tapesac variant.
    context: entered around every step of this variant (e.g. torch.compile's memory budget).
    prime_steps: steps run (and discarded) before the validation step: tapesac auto runs "full" in its first step
        while measuring and plans from the second, so the plan itself is what gets validated and measured.
    """

    name: str
    label: str
    kind: str
    step: Callable[[], torch.Tensor] | None = None
    model: nn.Module | None = None
    status: str = ""
    reason: str = ""
    exact: bool = True
    optional: bool = False
    block_forwards: int | None = None
    counter: list[int] | None = None
    sac: Any = None
    context: Callable[[], Any] | None = None
    prime_steps: int = 0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    """What a variant factory sees: the workload, the options, the package and the results measured so far."""

    work: Workload
    args: argparse.Namespace
    tapesac: Any
    results: dict[str, dict[str, Any]]
    floor: int | None = None  # tapesac's smallest feasible step peak, once a factory measured it (_tapesac_floor)

    @property
    def cuda(self) -> bool:
        return self.work.size.device.startswith("cuda")


def _placeholder(name: str, label: str, kind: str, status: str, reason: str) -> Variant:
    return Variant(name=name, label=label, kind=kind, status=status, reason=reason, optional=True)


def _restore_attr(obj: Any, name: str, saved: Any, missing: object) -> None:
    if saved is missing:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = saved


_MISSING = object()


@contextlib.contextmanager
def checkpointed_blocks(blocks: Sequence[nn.Module], counter: list[int] | None = None,
                        context_fn: Callable[[], Any] | None = None) -> Iterator[None]:
    """Runs each block's forward under torch.utils.checkpoint (non-reentrant) while the context is open.

    The blocks are not replaced: their instance `forward` is patched and restored on exit, so the model's
    structure, attribute lookups (HF reads `layer.attention_type`) and state_dict keys stay the same. Keyword
    arguments (HF's attention_mask, position_embeddings, ...) go through checkpoint unchanged. `counter[0]` counts
    every call of the original forward (forward and recompute), which shows that checkpointing really happens.
    """
    from torch.utils.checkpoint import checkpoint

    saved = []
    for b in blocks:
        saved.append(b.__dict__.get("forward", _MISSING))
        orig = b.forward

        def counted(*args: Any, _orig: Callable[..., Any] = orig, **kwargs: Any) -> Any:
            if counter is not None:
                counter[0] += 1
            return _orig(*args, **kwargs)

        def ckpt_forward(*args: Any, _fn: Callable[..., Any] = counted, **kwargs: Any) -> Any:
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_fn, *args, use_reentrant=False, **extra, **kwargs)

        b.forward = ckpt_forward
    try:
        yield
    finally:
        for b, s in zip(blocks, saved):
            _restore_attr(b, "forward", s, _MISSING)


def _ops(names: Sequence[str]) -> list[Any]:
    """OpOverloads for 'aten.name.overload' strings; names this torch build lacks are skipped."""
    out = []
    for n in names:
        ns, op, overload = n.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        ov = getattr(packet, overload, None) if packet is not None else None
        if ov is not None:
            out.append(ov)
    return out


# torchtitan's SelectiveAC (torchtitan/distributed/activation_checkpoint.py), adapted to CPU: save the outputs of
# compute-intensive ops (attention kernels of every backend, including SDPA's CPU flash kernel; scaled and grouped
# matmuls; router topk; max) and of every other matmul (the 1st, 3rd, ... mm/addmm/bmm of a block, counted
# separately in forward and in recompute, as torchtitan counts mm); recompute everything else.
TORCHTITAN_SAVE = (
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_mm.default",
    "aten.topk.default",
    "aten.max.default",
)
TORCHTITAN_ALTERNATE = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._grouped_mm.default")


def torchtitan_context_fn() -> Callable[[], Any]:
    """A context_fn for torch.utils.checkpoint: PyTorch SAC with the torchtitan-style policy (fresh counters per
    checkpointed call)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = set(_ops(TORCHTITAN_SAVE))
    alternate = set(_ops(TORCHTITAN_ALTERNATE))

    def context_fn() -> Any:
        counts: collections.Counter[str] = collections.Counter()

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            if func in alternate:
                mode = "recompute" if ctx.is_recompute else "forward"
                counts[mode] += 1
                keep = counts[mode] % 2 == 1
            else:
                keep = func in save
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _plain_step(work: Workload, model: Callable[..., Any] | None = None) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = work.loss(model)
        loss.backward()
        return loss

    return step


def nockpt_variants(ctx: Ctx) -> list[Variant]:
    """The baseline: no checkpointing. Always first: every other variant is validated against it."""
    return [Variant(name=NOCKPT, label="no checkpointing", kind="baseline", step=_plain_step(ctx.work),
                    block_forwards=None)]


def pytorch_checkpoint_variants(ctx: Ctx) -> list[Variant]:
    """torch.utils.checkpoint (non-reentrant) per decoder layer, and PyTorch SAC with the torchtitan policy."""
    work = ctx.work
    n_blocks = len(work.blocks)
    out = []
    for name, label, context_fn in ((CKPT, "torch.utils.checkpoint per layer", None),
                                    ("torch_sac", "PyTorch SAC, torchtitan policy", torchtitan_context_fn())):
        counter = [0]

        def step(counter: list[int] = counter, context_fn: Any = context_fn) -> torch.Tensor:
            with checkpointed_blocks(work.blocks, counter, context_fn):
                loss = work.loss()
                loss.backward()
            return loss

        out.append(Variant(name=name, label=label, kind="pytorch", step=step, block_forwards=2 * n_blocks,
                           counter=counter, optional=True))
    return out


def _compile_unavailable(ctx: Ctx) -> str:
    """Why torch.compile cannot run here ('' when it can)."""
    if ctx.args.no_compile:
        return "skipped: --no-compile"
    if ctx.cuda:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"skipped: inductor on CUDA needs triton ({e})"
        return ""
    if not ctx.args.compile:
        return ("skipped: on CPU, inductor compiles C++ kernels for every graph (minutes on a 2-core machine); "
                "pass --compile to run it")
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None and shutil.which("c++") is None:
        return f"skipped: inductor on CPU needs a C++ compiler; none found ({cxx!r}, 'c++' not on PATH)"
    return ""


def compile_variants(ctx: Ctx) -> list[Variant]:
    """torch.compile with torch._functorch.config.activation_memory_budget (one variant per --compile-budgets)."""
    budgets = _fractions(ctx.args.compile_budgets)
    out = []
    why = _compile_unavailable(ctx)
    for b in budgets:
        name, label = f"compile_b{b:g}", f"torch.compile, activation_memory_budget={b:g}"
        if why:
            out.append(_placeholder(name, label, "compile", "skipped", why.removeprefix("skipped: ")))
            continue
        model = copy.deepcopy(ctx.work.pristine)
        compiled = torch.compile(model)

        def budget(b: float = b) -> Any:
            import torch._functorch.config as fc

            return fc.patch(activation_memory_budget=b)

        out.append(Variant(name=name, label=label, kind="compile", step=_plain_step(ctx.work, compiled), model=model,
                           exact=False, optional=True, context=budget, info={"budget": b}))
    return out


# Candidate op names (as tapesac.record_ops reports them) for tapesac's static policy: the compute-intensive ops.
# The policy keeps those the model's forward actually runs (a name never seen would only trigger a warning).
TAPESAC_STATIC_CANDIDATES = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
)


def _tapesac_step(ctx: Ctx, sac: Any) -> Callable[[], torch.Tensor]:
    work = ctx.work

    def step() -> torch.Tensor:
        with sac.step():
            loss = work.loss()
            loss.backward()
        return loss

    return step


def _tapesac_variant(ctx: Ctx, name: str, label: str, **sac_kwargs: Any) -> Variant:
    sac = ctx.tapesac.TapeSAC(ctx.work.model, blocks="model.layers.*", **sac_kwargs)
    return Variant(name=name, label=label, kind="tapesac", step=_tapesac_step(ctx, sac), sac=sac,
                   info={k: (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in sac_kwargs.items()})


def tapesac_variants(ctx: Ctx) -> list[Variant]:
    """tapesac policy "none" (record and measure only), "full", and a static op set (the compute-intensive ops)."""
    seen = set(ctx.tapesac.record_ops(lambda: ctx.work.loss()))
    static = frozenset(op for op in TAPESAC_STATIC_CANDIDATES if op in seen)
    short = ",".join(sorted(o.removeprefix("aten::").replace("_scaled_dot_product_", "sdpa_") for o in static))
    out = [
        _tapesac_variant(ctx, "tapesac_none", 'tapesac policy="none"', policy="none"),
        _tapesac_variant(ctx, "tapesac_full", 'tapesac policy="full"', policy="full"),
        _tapesac_variant(ctx, "tapesac_ops", f"tapesac policy={{{short}}}", policy=static),
    ]
    for v in out[1:]:
        v.prime_steps = 2  # their default replay schedules are planned after a first step (Config.schedule "auto")
    return out


def _tapesac_floor(ctx: Ctx, above: int) -> int:
    """tapesac's smallest feasible step peak on the workload: the first limit of the planner's frontier after one
    measuring step under a generous limit (`above`). A memory_limit below it raises MemoryLimitError."""
    sac = ctx.tapesac.TapeSAC(ctx.work.model, blocks="model.layers.*", policy="auto", memory_limit=int(above))
    try:
        torch.manual_seed(ctx.args.seed)
        with sac.step():
            ctx.work.loss().backward()
        return int(sac.frontier(points=2).planned[0]["limit_bytes"])
    finally:
        ctx.work.model.zero_grad(set_to_none=True)
        sac.close()


def _limit_targets(ctx: Ctx) -> tuple[list[tuple[str, int]], str]:
    """(label, memory_limit bytes) for tapesac auto at fractions of the way from the lowest step peak tapesac can
    promise — ckpt's measured step peak, or tapesac's own floor when that is higher — to nockpt's; or no targets and
    why. All are step peaks (measure.PEAK_DEFINITION), the quantity memory_limit bounds."""
    res = ctx.results
    lo, hi = res.get(CKPT, {}).get("peak_bytes"), res.get(NOCKPT, {}).get("peak_bytes")
    if not lo or not hi:
        return [], "needs the measured peaks of nockpt and ckpt"
    floor = ctx.floor = _tapesac_floor(ctx, 4 * hi)
    if floor >= hi:
        return [], (f"tapesac's smallest feasible step peak on this workload ({floor / MiB:.2f} MiB: the least every "
                    f"block keeps plus one block's replay) is not below no checkpointing's ({hi / MiB:.2f} MiB): no "
                    f"limit between ckpt's peak and nockpt's is feasible")
    lo = max(lo, floor)
    fracs = _fractions(ctx.args.auto_fractions)
    return [(f"{f:g}", int(lo + f * (hi - lo))) for f in fracs], ""


def tapesac_auto_variants(ctx: Ctx) -> list[Variant]:
    """tapesac policy="auto" under several memory limits (from the lowest step peak tapesac can promise — full
    checkpointing's, or tapesac's own floor when higher — to no checkpointing's), each primed two steps (step 1 runs
    "full" while measuring, the plan applies from step 2). None when no such limit is feasible (a skipped entry says
    why)."""
    targets, why = _limit_targets(ctx)
    if not targets:
        return [_placeholder("tapesac_auto", 'tapesac policy="auto"', "tapesac", "skipped", why)]
    out = []
    for frac, limit in targets:
        v = _tapesac_variant(ctx, f"tapesac_auto_{frac}", f'tapesac auto, limit {limit / MiB:.0f} MiB ({frac})',
                             policy="auto", memory_limit=limit)
        v.optional = True
        v.prime_steps = 2
        v.info["limit_fraction"] = float(frac)
        v.info["memory_limit_bytes"] = limit  # comparable with the measured step peak
        out.append(v)
    return out


def tapesac_auto_at_sac_peak_variants(ctx: Ctx) -> list[Variant]:
    """tapesac policy="auto" with the limit at PyTorch SAC's measured peak: the same memory, who is faster."""
    name, label = "tapesac_auto_sac_peak", "tapesac auto, limit = PyTorch SAC's peak"
    sac_peak = ctx.results.get("torch_sac", {}).get("peak_bytes")
    if not sac_peak:
        return [_placeholder(name, label, "tapesac", "skipped", "needs PyTorch SAC's measured peak")]
    if ctx.floor is not None and sac_peak < ctx.floor:
        return [_placeholder(name, label, "tapesac", "skipped",
                             f"PyTorch SAC's step peak ({sac_peak / MiB:.2f} MiB) is below tapesac's smallest feasible "
                             f"step peak on this workload ({ctx.floor / MiB:.2f} MiB)")]
    v = _tapesac_variant(ctx, name, label, policy="auto", memory_limit=int(sac_peak))
    v.optional = True
    v.prime_steps = 2
    v.info["memory_limit_bytes"] = int(sac_peak)
    return [v]


def tapesac_schedule_variants(ctx: Ctx) -> list[Variant]:
    """tapesac with replay schedules (Config.schedule): "full" with the lazy and hold_all shapes and with planned
    schedules (the least predicted peak), and "auto" with planned schedules at 0.9x checkpointing's measured step peak (below the
    one-segment floor)."""
    one = _tapesac_variant(ctx, "tapesac_full_one_segment", 'tapesac "full", schedule="one_segment"', policy="full",
                           schedule="one_segment")
    lazy = _tapesac_variant(ctx, "tapesac_full_lazy", 'tapesac "full", schedule="lazy"', policy="full",
                            schedule="lazy")
    planned = _tapesac_variant(ctx, "tapesac_full_planned", 'tapesac "full", schedule="planned", least peak',
                               policy="full", schedule="planned", schedule_budget=None)
    hold_all = _tapesac_variant(ctx, "tapesac_full_hold_all", 'tapesac "full", schedule="hold_all"', policy="full",
                                schedule="hold_all")
    planned.prime_steps = 2
    out = [one, lazy, hold_all, planned]
    for pct in SCHEDULE_BUDGETS_PCT:
        v = _tapesac_variant(ctx, f"tapesac_full_planned_b{pct:02d}",
                             f'tapesac "full", schedule="planned", schedule_budget={pct / 100:g}', policy="full",
                             schedule="planned", schedule_budget=pct / 100)
        v.prime_steps = 2
        out.append(v)
    for v in out:
        v.optional = True
    ckpt_peak = ctx.results.get(CKPT, {}).get("peak_bytes")
    if ckpt_peak:
        limit = int(0.9 * ckpt_peak)
        v = _tapesac_variant(ctx, "tapesac_auto_planned_ckpt90", 'tapesac auto, schedule="planned", 0.9x ckpt peak',
                             policy="auto", schedule="planned", memory_limit=limit)
        v.optional = True
        v.prime_steps = 3
        v.info["memory_limit_bytes"] = limit
        out.append(v)
    return out


# The policy both replay backends run with, so that tapesac_eager vs tapesac_cuda_graph isolates the backend.
BACKEND_POLICY = "full"


def tapesac_backend_variants(ctx: Ctx) -> list[Variant]:
    """tapesac with the same policy under each replay backend: backend="eager" (replay through the dispatcher) and
    backend="cuda_graph" (replay as pruned CUDA-graph launches; GPU only). The graph variant primes two steps (the
    first replay of a block signature runs eagerly, the second captures), so validation, the peak and every timed
    step see graph launches; a validation step that launched no graph makes it invalid."""
    eager = _tapesac_variant(ctx, "tapesac_eager", f'tapesac policy="{BACKEND_POLICY}", backend="eager"',
                             policy=BACKEND_POLICY, backend="eager")
    name, label = "tapesac_cuda_graph", f'tapesac policy="{BACKEND_POLICY}", backend="cuda_graph"'
    if not ctx.cuda:
        return [eager, _placeholder(name, label, "tapesac", "skipped",
                                    "needs a CUDA workload (backend='cuda_graph' replays CUDA graphs); this "
                                    f"workload runs on {ctx.work.size.device}")]
    try:  # the GPU backend is optional: a build without nvcc has none
        graph = _tapesac_variant(ctx, name, label, policy=BACKEND_POLICY, backend="cuda_graph")
    except ctx.tapesac.ConfigError as e:
        return [eager, _placeholder(name, label, "tapesac", "unavailable",
                                    f"CUDA-graph backend unavailable (ConfigError: {str(e).split(';')[0]})")]
    graph.prime_steps = 2
    graph.info["expect_graph_replays"] = True
    return [eager, graph]


def _fractions(text: str) -> list[float]:
    return [float(f) for f in text.split(",") if f.strip()]


def variant_names(args: argparse.Namespace) -> set[str]:
    """Every name VARIANT_FACTORIES can make under these arguments (placeholders included), known before anything
    runs: `--variants` is checked against it up front. A factory that makes a name missing here fails the suite's
    own check (run.bench_workload), so the two cannot drift apart."""
    names = {NOCKPT, CKPT, "torch_sac", "tapesac_none", "tapesac_full", "tapesac_ops", "tapesac_auto",
             "tapesac_auto_sac_peak", "tapesac_eager", "tapesac_cuda_graph", "tapesac_full_one_segment",
             "tapesac_full_lazy", "tapesac_full_planned", "tapesac_full_hold_all", "tapesac_auto_planned_ckpt90"}
    names |= {f"compile_b{b:g}" for b in _fractions(args.compile_budgets)}
    names |= {f"tapesac_auto_{f:g}" for f in _fractions(args.auto_fractions)}
    names |= {f"tapesac_full_planned_b{pct:02d}" for pct in SCHEDULE_BUDGETS_PCT}
    return names


# The suite, in order. Each factory: Ctx -> list[Variant]. Append a factory to add variants; a factory runs after
# the variants before it were validated and measured (ctx.results holds their numbers).
VARIANT_FACTORIES: list[Callable[[Ctx], list[Variant]]] = [
    nockpt_variants,
    pytorch_checkpoint_variants,
    compile_variants,
    tapesac_variants,
    tapesac_auto_variants,
    tapesac_auto_at_sac_peak_variants,
    tapesac_backend_variants,
    tapesac_schedule_variants,
]

