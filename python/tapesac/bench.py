# tapesac.bench — one training step of HF decoder models under every checkpointing tool, side by side.
#
# Contract:
# - `main(argv) -> int` (`python -m tapesac bench ...`, `python perf/bench_step.py ...`). Exit status 1 when a
#   required variant (the baseline and tapesac none/full/static) is invalid (its loss or a gradient differs from
#   no checkpointing) or crashed. The peers (PyTorch checkpoint and SAC, torch.compile) and tapesac features not
#   built yet are optional: their failures are findings, reported in the table and the JSON, never fatal.
# - One process, one model per (architecture, size), the same input batch for every variant. The eager
#   variants share that model object (each installs itself around its step only: patched block forwards,
#   or tapesac's `with sac.step()`); torch.compile gets a deep copy made before any step (identical weights).
# - Variants come from VARIANT_FACTORIES, called in order; each factory returns Variant objects, or
#   placeholders saying why a variant is unavailable or skipped. A variant is validated and its peak memory
#   measured as soon as its factory returns it, so a later factory (tapesac auto at several limits) can read
#   the peaks measured before it (ctx.results).
# - Validation before timing: one step from the same seed; loss and every parameter gradient compared with
#   the no-checkpoint step: bitwise on CPU for exact variants; torch.compile within a tolerance (see
#   _COMPILE_RTOL). Checkpoint variants must really recompute (each block's forward runs twice per step);
#   tapesac "full" must drop and replay. An invalid variant is reported as invalid and never timed.
# - Timing: `warmup` rounds, then `rounds` rounds; every round runs every valid variant once (forward +
#   backward + zero_grad(set_to_none)), in an order that rotates each round; gc disabled while timing.
#   Per variant: median step time with IQR and min/max; ratios are medians of per-round ratios (paired:
#   robust to machine-wide slowdowns) to no checkpointing ("nockpt") and to torch.utils.checkpoint ("ckpt").
# - Peak memory (bytes above the level at step entry), one dedicated step per variant after validation:
#   CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats; CPU: tapesac.MemoryMeter when the
#   installed package has it, else torch.profiler memory events (profile_memory=True, running sum of the
#   CPU allocation/free events). The method used is printed and stored in the JSON.
# - Recompute time: tapesac variants report `sac.last_step.replay_ms` (measured); the others report
#   median(step) - median(nockpt step), labelled as an estimate.
# - `--json PATH`: environment (git commit, torch, transformers, CUDA, device, CPU, threads, date) + every
#   number. `--plot PATH`: the memory/time plane (one panel per model). `--train-steps N`: the long mode
#   (training on Austen with full checkpointing vs tapesac, loss curves and wall clock; `--train-plot PNG`).
#   Progress goes to stderr. `--from-json PATH` reprints the tables and redraws the plots of a saved run.
# - CPU runs use one intra-op thread unless --threads says otherwise; main() restores torch's thread count and
#   deterministic-algorithms flag when it returns (tests call it in-process).
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["main", "build_parser", "VARIANT_FACTORIES", "LONG_VARIANT_FACTORIES", "Variant", "SIZES", "ARCHS"]

SCHEMA_VERSION = 1
MiB = float(2**20)
ARCHS = ("qwen3", "qwen3_moe", "llama")
NOCKPT, CKPT = "nockpt", "ckpt"

# torch.compile reorders and fuses float reductions (RMSNorm means, softmax, matmul epilogues), so its loss and
# gradients differ from eager in the last bits: compare with a relative tolerance on each tensor's scale. fp32 on
# CPU measured 1.4e-6 to 3.7e-6 (2026-11-29 results); bf16 keeps 8 mantissa bits (one rounding is 4e-3), and
# reordered sums over thousands of terms compound it.
_COMPILE_RTOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}
# CUDA kernels (SDPA backward, cuBLAS split-K) may reorder reductions between runs even for the same inputs; when
# the no-checkpoint reference is not bitwise reproducible on the device, exact variants get this tolerance.
_DEVICE_RTOL = 1e-2


# ----------------------------------------------------------------------------------------------------------------
# Models and sizes
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Size:
    """One model size: builder kwargs shared by the architectures plus per-architecture overrides.

    batch, seq: the input batch [batch, seq] of random token ids.
    dtype: parameter dtype. device: "cpu" or "cuda".
    common: kwargs for every builder in tapesac.models; qwen3 / llama / moe: extra kwargs per architecture.
    note: what the size is for (printed).
    """

    batch: int
    seq: int
    common: dict[str, Any]
    qwen3: dict[str, Any] = field(default_factory=dict)
    llama: dict[str, Any] = field(default_factory=dict)
    moe: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"
    note: str = ""


SIZES: dict[str, Size] = {
    "smoke": Size(
        batch=2, seq=32, note="CI smoke: seconds",
        common=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    ),
    "demo": Size(
        batch=8, seq=128, note="the model of `python -m tapesac demo`",
        common=dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2),
    ),
    "small": Size(
        batch=4, seq=256, note="CPU: a step well under a second",
        common=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        qwen3=dict(intermediate_size=768),
        moe=dict(intermediate_size=768, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2),
    ),
    "medium": Size(
        batch=4, seq=256, note="CPU: matrix products dominate",
        common=dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64),
        qwen3=dict(intermediate_size=1536),
        moe=dict(intermediate_size=1536, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2),
    ),
    # peers.md §5.1 H200 recipe: Qwen3 ~1B (V32000, tied), TinyLlama shape, a ~1B-total Qwen3-MoE; bf16, seq 4096.
    "gpu1b": Size(
        batch=4, seq=4096, dtype="bfloat16", device="cuda", note="GPU: about 1B parameters at sequence 4096",
        common=dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=8, max_position_embeddings=4096),
        qwen3=dict(head_dim=128, intermediate_size=6144),
        llama=dict(num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632),
        moe=dict(num_hidden_layers=12, moe_intermediate_size=1536, num_experts=8, num_experts_per_tok=2),
    ),
}


def build_model(arch: str, size: Size, seed: int = 0) -> nn.Module:
    """A freshly initialised HF model (random weights from `seed`; nothing downloaded), in train mode."""
    from . import models

    builders = {"qwen3": (models.tiny_qwen3, size.qwen3), "llama": (models.tiny_llama, size.llama),
                "qwen3_moe": (models.tiny_qwen3_moe, size.moe)}
    if arch not in builders:
        raise SystemExit(f"unknown model {arch!r}; expected one of {list(ARCHS)}")
    fn, extra = builders[arch]
    kwargs = {**size.common, **extra}
    if arch == "qwen3_moe":
        kwargs.pop("head_dim", None)  # tiny_qwen3_moe takes no head_dim (hidden / heads)
    if arch == "llama" and "head_dim" in kwargs and "head_dim" not in extra:
        kwargs.pop("head_dim")
    model = fn(seed=seed, **kwargs)
    return model.to(device=size.device, dtype=getattr(torch, size.dtype))


def describe_model(arch: str, model: nn.Module) -> str:
    from .models import param_count

    c = model.config
    moe = f" E{c.num_experts} top{c.num_experts_per_tok} I_moe{c.moe_intermediate_size}" if arch == "qwen3_moe" else ""
    return (f"{type(model).__name__} H{c.hidden_size} L{c.num_hidden_layers} heads {c.num_attention_heads}/"
            f"{c.num_key_value_heads} I{c.intermediate_size}{moe} V{c.vocab_size}, "
            f"{param_count(model) / 1e6:.2f} M params")


# ----------------------------------------------------------------------------------------------------------------
# The workload and the variants
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One model and one input batch; every variant trains this (or, for torch.compile, a copy made first)."""

    name: str  # "small/qwen3"
    arch: str
    size_name: str
    size: Size
    model: nn.Module
    pristine: nn.Module  # an untouched deep copy (on CPU memory or the device), for variants that need their own
    ids: torch.Tensor  # [batch, seq] int64
    description: str

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.model.model.layers)

    def loss(self, model: Callable[..., Any] | None = None) -> torch.Tensor:
        return (self.model if model is None else model)(input_ids=self.ids, labels=self.ids).loss


@dataclass
class Variant:
    """One way to run a training step.

    name: key in the results ("tapesac_full"); label: what the table prints.
    kind: "baseline" | "pytorch" | "compile" | "tapesac".
    step: runs forward + backward once and returns the loss (None for a placeholder).
    model: the module whose parameters get the gradients (the workload's model unless the variant has a copy).
    status: "" for a runnable variant, else "unavailable" or "skipped" with `reason`.
    exact: compared bitwise on CPU (else within _COMPILE_RTOL of the model's dtype).
    optional: an invalid result or a crash is reported but does not fail the run (peer tools, features not built
        yet); required variants (the baseline, tapesac's built modes) fail it.
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
    budgets = [float(b) for b in ctx.args.compile_budgets.split(",") if b.strip()]
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
    return [
        _tapesac_variant(ctx, "tapesac_none", 'tapesac policy="none"', policy="none"),
        _tapesac_variant(ctx, "tapesac_full", 'tapesac policy="full"', policy="full"),
        _tapesac_variant(ctx, "tapesac_ops", f"tapesac policy={{{short}}}", policy=static),
    ]


def _limit_targets(ctx: Ctx) -> list[tuple[str, int, int]]:
    """(label, memory_limit bytes, the limit above the step baseline) for tapesac auto at fractions of the way
    from ckpt's peak to nockpt's. memory_limit bounds the whole step peak (tapesac.memory), so the limit adds the
    step baseline: CPU, the bytes of parameters and buffers (gradients are None at step entry); CUDA, all memory
    allocated at entry."""
    res = ctx.results
    lo, hi = res.get(CKPT, {}).get("peak_bytes"), res.get(NOCKPT, {}).get("peak_bytes")
    if not lo or not hi:
        return []
    if ctx.cuda:
        entry = torch.cuda.memory_allocated()
    else:
        model = ctx.work.model
        entry = _model_bytes(ctx.work.model)
    fracs = [float(f) for f in ctx.args.auto_fractions.split(",") if f.strip()]
    return [(f"{f:g}", int(entry + lo + f * (hi - lo)), int(lo + f * (hi - lo))) for f in fracs]


def _model_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameters and buffers (tied weights once)."""
    ts = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in ts)


def tapesac_auto_variants(ctx: Ctx) -> list[Variant]:
    """tapesac policy="auto" under several memory limits (between full checkpointing's peak and no checkpointing's).

    The hook for the planner: today TapeSAC(memory_limit=...) raises ConfigError, which is reported as
    "unavailable (planner not built)"; once it accepts a limit, these variants run and are timed like the others.
    """
    targets = _limit_targets(ctx)
    if not targets:
        return [_placeholder("tapesac_auto", 'tapesac policy="auto"', "tapesac", "skipped",
                             "needs the measured peaks of nockpt and ckpt")]
    try:
        probe = ctx.tapesac.TapeSAC(ctx.work.model, blocks="model.layers.*", policy="auto",
                                    memory_limit=targets[-1][1])
    except ctx.tapesac.ConfigError as e:
        return [_placeholder("tapesac_auto", 'tapesac policy="auto"', "tapesac", "unavailable",
                             f"planner not built (TapeSAC(policy='auto', memory_limit=...) raised ConfigError: "
                             f"{str(e).split(';')[0]})")]
    probe.close()
    out = []
    for frac, limit, above in targets:
        v = _tapesac_variant(ctx, f"tapesac_auto_{frac}", f'tapesac auto, limit {limit / MiB:.0f} MiB ({frac})',
                             policy="auto", memory_limit=limit)
        v.optional = True
        v.prime_steps = 2
        v.info["limit_fraction"] = float(frac)
        v.info["limit_above_entry_bytes"] = above  # comparable with the measured peak
        out.append(v)
    return out


def tapesac_auto_at_sac_peak_variants(ctx: Ctx) -> list[Variant]:
    """tapesac policy="auto" with the limit at PyTorch SAC's measured peak: the same memory, who is faster."""
    name, label = "tapesac_auto_sac_peak", "tapesac auto, limit = PyTorch SAC's peak"
    sac_peak = ctx.results.get("torch_sac", {}).get("peak_bytes")
    if not sac_peak:
        return [_placeholder(name, label, "tapesac", "skipped", "needs PyTorch SAC's measured peak")]
    entry = torch.cuda.memory_allocated() if ctx.cuda else _model_bytes(ctx.work.model)
    try:
        v = _tapesac_variant(ctx, name, label, policy="auto", memory_limit=int(entry + sac_peak))
    except ctx.tapesac.TapeSACError as e:
        return [_placeholder(name, label, "tapesac", "unavailable", _short_error(e))]
    v.optional = True
    v.prime_steps = 2
    v.info["limit_above_entry_bytes"] = int(sac_peak)
    return [v]


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
    try:
        graph = _tapesac_variant(ctx, name, label, policy=BACKEND_POLICY, backend="cuda_graph")
    except ctx.tapesac.ConfigError as e:
        return [eager, _placeholder(name, label, "tapesac", "unavailable",
                                    f"CUDA-graph backend unavailable (ConfigError: {str(e).split(';')[0]})")]
    graph.prime_steps = 2
    graph.info["expect_graph_replays"] = True
    return [eager, graph]


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
]


# ----------------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------------


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class PeakMeter:
    """Peak bytes above the level at entry of one call. `method` says how it was measured."""

    def __init__(self, tapesac: Any, cuda: bool) -> None:
        self.tapesac = tapesac
        self.cuda = cuda
        if cuda:
            self.method = "torch.cuda.max_memory_allocated (delta over memory_allocated at step entry)"
        elif hasattr(tapesac, "MemoryMeter"):
            self.method = "tapesac.MemoryMeter (counting CPU allocator, peak above the level at step entry)"
        else:
            self.method = ("torch.profiler memory events (profile_memory=True): running sum of CPU allocations and "
                           "frees during the step, peak above the level at step entry")

    def measure(self, fn: Callable[[], Any]) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - base)
        if hasattr(self.tapesac, "MemoryMeter"):
            with self.tapesac.MemoryMeter() as m:
                fn()
            return int(m.peak_bytes)
        return _profiler_peak(fn)


def _profiler_peak(fn: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == cpu), key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return int(peak)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silences file descriptor 2 (libkineto prints profiler start/stop lines there from C++)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _telemetry_peak(stats: Any) -> tuple[Any, int | None]:
    """(JSON form of sac.last_step.memory, a peak in bytes found in it) when tapesac reports step memory."""
    mem = getattr(stats, "memory", None)
    if mem is None:
        return None, None
    raw = dataclasses.asdict(mem) if dataclasses.is_dataclass(mem) else mem
    raw = _jsonable(raw)
    peak = None
    if isinstance(raw, dict):
        # tapesac.MemoryStats: peak_above_baseline_bytes is the figure comparable with the measured peak (bytes
        # above the level at step entry); peak_bytes adds the baseline (parameters, buffers, gradients).
        for k in ("peak_above_baseline_bytes", "peak_bytes", "peak"):
            v = raw.get(k)
            if isinstance(v, (int, float)):
                peak = int(v)
                break
            if isinstance(v, dict) and isinstance(v.get("peak"), (int, float)):
                peak = int(v["peak"])
                break
    return raw, peak


GRAPH_COUNTERS = ("graph_replays", "graph_captures", "graph_fallbacks", "graph_staged_bytes", "graph_nodes_enabled",
                  "graph_nodes_disabled")


def _graph_stats(stats: Any) -> dict[str, Any] | None:
    """The CUDA-graph counters of a tapesac step summed over its block calls, with the distinct fallback reasons;
    None when this tapesac's BlockStats carry no graph counters."""
    blocks = getattr(stats, "blocks", ())
    if not blocks or not all(hasattr(blocks[0], k) for k in GRAPH_COUNTERS):
        return None
    out: dict[str, Any] = {k: sum(getattr(b, k) for b in blocks) for k in GRAPH_COUNTERS}
    out["graph_fallback_reasons"] = sorted({getattr(b, "graph_fallback", "") for b in blocks} - {""})
    return out


def _graph_launch_times(history: Any, top: int = 8) -> dict[str, Any] | None:
    """The per-op times of the timed graph launches in a tapesac's step history (TapeSAC(graph_timing=...); by
    default each graph's first launch, during the priming steps): per timed block call its step, source, device
    time, unattributed time and its `top` most expensive ops; the notes of launches that were to be timed and were
    not. None when nothing was timed or noted."""
    timed, notes = [], set()
    for st in history:
        for b in getattr(st, "blocks", ()):
            if getattr(b, "graph_timing_note", ""):
                notes.add(b.graph_timing_note)
            if getattr(b, "graph_timed_launches", 0):
                ops = sorted(b.graph_op_ms, key=lambda t: -t[2])[:top]
                timed.append({"step": st.step, "block": b.name, "launches": b.graph_timed_launches,
                              "source": b.graph_timing, "device_ms": b.graph_device_ms,
                              "unattributed_ms": b.graph_unattributed_ms,
                              "top_ops_ms": [[i, n, ms] for i, n, ms in ops]})
    if not timed and not notes:
        return None
    return {"timed": timed, "notes": sorted(notes)}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if dataclasses.is_dataclass(x):
        return _jsonable(dataclasses.asdict(x))
    return repr(x)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, tiny): the error relative to the tensor's scale."""
    d = (got.double() - want.double()).abs().max().item()
    return d / max(want.double().abs().max().item(), 1e-30)


@dataclass
class Snapshot:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms(True, warn_only=True) while open (validation steps on CUDA only: the
    deterministic kernels may be slower, so timed steps run without it)."""
    if not on:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _run_once(v: Variant, work: Workload, seed: int) -> Snapshot:
    """One step of `v` from `seed`; returns loss and cloned gradients and zeroes the gradients."""
    model = work.model if v.model is None else v.model
    torch.manual_seed(seed)
    cuda = work.size.device.startswith("cuda")
    with _deterministic(cuda), (v.context() if v.context else contextlib.nullcontext()):
        loss = v.step()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return Snapshot(loss.detach().clone(), grads)


def compare(got: Snapshot, want: Snapshot, rtol: float | None) -> tuple[bool, str, float]:
    """(valid, detail, max relative diff). rtol None: bitwise."""
    pairs = [("loss", got.loss, want.loss)]
    if list(got.grads) != list(want.grads):
        return False, f"parameter names differ: {sorted(set(got.grads) ^ set(want.grads))[:4]}", math.inf
    for n, g in want.grads.items():
        h = got.grads[n]
        if (g is None) != (h is None):
            return False, f"grad of {n}: {'missing' if h is None else 'present'}, reference " \
                          f"{'missing' if g is None else 'present'}", math.inf
        if g is not None:
            pairs.append((f"grad of {n}", h, g))
    worst, worst_name = 0.0, ""
    for name, a, b in pairs:
        if a.shape != b.shape:
            return False, f"{name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}", math.inf
        if _bits_equal(a, b):
            continue
        r = _rel_diff(a, b)
        if r > worst:
            worst, worst_name = r, name
        if rtol is None:
            return False, f"{name} not bitwise equal to no checkpointing (max diff {r:.2e} of its max)", r
    if rtol is not None and worst > rtol:
        return False, f"{worst_name}: relative difference {worst:.2e} > tolerance {rtol:g}", worst
    n = len(pairs)
    if worst == 0.0:
        return True, f"loss and {n - 1} gradients bitwise equal", 0.0
    return True, f"loss and {n - 1} gradients within rtol {rtol:g} (max {worst:.2e}, {worst_name})", worst


def _stats(xs: Sequence[float]) -> dict[str, float]:
    s = sorted(xs)

    def q(p: float) -> float:
        if len(s) == 1:
            return s[0]
        pos = p * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median": statistics.median(s), "q1": q(0.25), "q3": q(0.75), "iqr": q(0.75) - q(0.25),
            "min": s[0], "max": s[-1], "n": len(s)}


class Progress:
    """One status line on stderr: rewritten in place on a terminal, else printed at most every `every` seconds."""

    def __init__(self, enabled: bool = True, every: float = 10.0) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.every = every
        self.last = 0.0
        self.t0 = time.perf_counter()

    def __call__(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        line = f"[bench {now - self.t0:6.0f}s] {text}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
        elif force or now - self.last >= self.every:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            self.last = now

    def done(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------------------------------
# One workload: build, validate, measure memory, time
# ----------------------------------------------------------------------------------------------------------------


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:400]


def _validate_and_measure(v: Variant, ctx: Ctx, ref: Snapshot | None, rtol_exact: float | None,
                          meter: PeakMeter, res: dict[str, Any]) -> bool:
    """Fills res with validation and peak memory; True when the variant may be timed."""
    work = ctx.work
    n_blocks = len(work.blocks)
    try:
        for _ in range(v.prime_steps):
            _run_once(v, work, ctx.args.seed)
        if v.counter is not None:
            v.counter[0] = 0
        snap = _run_once(v, work, ctx.args.seed)
        if ref is None:  # the baseline: it is the reference
            res["validation"] = {"valid": True, "detail": "reference", "max_rel_diff": 0.0, "method": "reference"}
        else:
            rtol = _COMPILE_RTOL.get(work.size.dtype, 5e-2) if not v.exact else rtol_exact
            ok, detail, worst = compare(snap, ref, rtol)
            method = "bitwise" if rtol is None else f"rtol {rtol:g}"
            if ok and v.block_forwards is not None and v.counter is not None and v.counter[0] != v.block_forwards:
                ok, detail = False, (f"did not checkpoint: {v.counter[0]} block forwards in one step, expected "
                                     f"{v.block_forwards} (each of the {n_blocks} blocks run again in backward)")
            if ok and v.sac is not None:
                st = v.sac.last_step
                policy = st.policy
                if policy == "none" and st.dropped_bytes:
                    ok, detail = False, f'policy "none" dropped {st.dropped_bytes} bytes'
                if policy == "full" and (not st.dropped_bytes or not st.ops_replayed):
                    ok, detail = False, (f'policy "full" dropped {st.dropped_bytes} bytes and replayed '
                                         f"{st.ops_replayed} ops: tapesac did nothing")
                graphs = _graph_stats(st)
                if ok and v.info.get("expect_graph_replays") and not (graphs or {}).get("graph_replays"):
                    found = graphs if graphs is not None else "BlockStats has no graph_replays"
                    ok, detail = False, (f"backend='cuda_graph' launched no graph in the validated step (step "
                                         f"{v.prime_steps + 1}): {found}")
            res["validation"] = {"valid": ok, "detail": detail, "max_rel_diff": worst, "method": method}
            if not ok:
                res["status"] = "invalid"
                res["reason"] = detail
                return False
        if v.counter is not None:
            res["block_forwards_per_step"] = v.counter[0]
        if v.sac is not None:
            st = v.sac.last_step
            res["tapesac"] = {k: getattr(st, k) for k in ("ops_recorded", "saved_tensors", "kept_tensors",
                                                          "dropped_tensors", "kept_bytes", "dropped_bytes",
                                                          "opaque_bytes", "replays", "ops_replayed", "replay_ms")}
            res["tapesac"]["backend"] = v.sac.backend
            graphs = _graph_stats(st)
            if graphs is not None:
                res["tapesac"].update(graphs)
            launch_times = _graph_launch_times(v.sac.history)
            if launch_times is not None:
                res["tapesac"]["graph_launch_times"] = launch_times
        # One more step, measured (the validation step also warmed the variant up).
        model = work.model if v.model is None else v.model

        def one() -> None:
            torch.manual_seed(ctx.args.seed)
            with (v.context() if v.context else contextlib.nullcontext()):
                v.step()

        peak = meter.measure(one)
        model.zero_grad(set_to_none=True)
        res["peak_bytes"] = peak
        if "limit_above_entry_bytes" in v.info:
            res["within_limit"] = peak <= v.info["limit_above_entry_bytes"]
        if v.sac is not None:
            raw, tel_peak = _telemetry_peak(v.sac.last_step)
            if raw is not None:
                res["telemetry_memory"] = raw
                res["telemetry_peak_bytes"] = tel_peak
                if tel_peak:
                    res["telemetry_peak_ratio_to_measured"] = tel_peak / peak if peak else None
        return True
    except Exception as e:  # one broken variant must not stop the suite
        model = work.model if v.model is None else v.model
        model.zero_grad(set_to_none=True)
        res["status"] = "error"
        res["reason"] = _short_error(e)
        return False


def bench_workload(work: Workload, args: argparse.Namespace, tapesac: Any, meter: PeakMeter,
                   progress: Progress, factories: Sequence[Callable[[Ctx], list[Variant]]]) -> dict[str, Any]:
    cuda = work.size.device.startswith("cuda")
    results: dict[str, dict[str, Any]] = {}
    ctx = Ctx(work=work, args=args, tapesac=tapesac, results=results)
    runnable: list[Variant] = []
    wanted = set(args.variants.split(",")) if args.variants else None
    ref: Snapshot | None = None
    rtol_exact: float | None = None
    out: dict[str, Any] = {"name": work.name, "model": work.arch, "size": work.size_name,
                           "description": work.description, "batch": work.size.batch, "seq": work.size.seq,
                           "dtype": work.size.dtype, "device": work.size.device, "blocks": len(work.blocks)}
    made_names: set[str] = set()
    for factory in factories:
        try:
            made = factory(ctx)
        except Exception as e:
            name = factory.__name__.removesuffix("_variants")
            required = factory in (nockpt_variants, tapesac_variants)
            results[name] = {"label": name, "kind": "?", "status": "error", "optional": not required,
                             "reason": f"variant factory failed: {_short_error(e)}"}
            continue
        for v in made:
            made_names.add(v.name)
            if wanted is not None and v.name not in wanted and v.name != NOCKPT:
                if v.sac is not None:
                    v.sac.close()
                continue
            res: dict[str, Any] = {"label": v.label, "kind": v.kind, "status": v.status or "ok",
                                   "optional": v.optional, "info": _jsonable(v.info)}
            results[v.name] = res
            if v.status:
                res["reason"] = v.reason
                continue
            progress(f"{work.name}: validating {v.name}", force=True)
            if v.name == NOCKPT:
                try:
                    ref = _run_once(v, work, args.seed)
                    again = _run_once(v, work, args.seed)
                except Exception as e:
                    work.model.zero_grad(set_to_none=True)
                    res["status"], res["reason"] = "error", f"the reference step failed: {_short_error(e)}"
                    continue
                same, _, _ = compare(again, ref, None)
                if not same:
                    # Not reproducible on this device: bitwise comparison would fail every variant.
                    rtol_exact = _DEVICE_RTOL
                out["reference_reproducible"] = same
            elif ref is None:
                res["status"], res["reason"] = "skipped", "no reference: the nockpt step failed"
                res["optional"] = True
                if v.sac is not None:
                    v.sac.close()
                continue
            if _validate_and_measure(v, ctx, None if v.name == NOCKPT else ref, rtol_exact, meter, res):
                runnable.append(v)
    out["exact_rtol"] = rtol_exact
    if wanted is not None:
        # A misspelt --variants name must not silently run nothing.
        out["unknown_variants"] = sorted(wanted - made_names)
        out["known_variants"] = sorted(made_names)

    # Timing: warm-up rounds, then rounds; rotating order; paired per round.
    times: dict[str, list[float]] = {v.name: [] for v in runnable}
    replay: dict[str, list[float]] = {v.name: [] for v in runnable if v.sac is not None}
    failed: set[str] = set()
    total = args.warmup + args.rounds
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(total):
            live = [v for v in runnable if v.name not in failed]
            k = r % max(1, len(live))
            order = live[k:] + live[:k]
            for v in order:
                progress(f"{work.name}: {'warm-up' if r < args.warmup else 'round'} "
                         f"{r + 1 - (0 if r < args.warmup else args.warmup)}/"
                         f"{args.warmup if r < args.warmup else args.rounds} {v.name}")
                model = work.model if v.model is None else v.model
                try:
                    torch.manual_seed(args.seed)
                    cm = v.context() if v.context else contextlib.nullcontext()
                    _sync(cuda)
                    t0 = time.perf_counter()
                    with cm:
                        v.step()
                    model.zero_grad(set_to_none=True)
                    _sync(cuda)
                    dt = time.perf_counter() - t0
                except Exception as e:
                    model.zero_grad(set_to_none=True)
                    failed.add(v.name)
                    results[v.name]["status"] = "error"
                    results[v.name]["reason"] = f"failed while timing: {_short_error(e)}"
                    continue
                if r >= args.warmup:
                    times[v.name].append(dt)
                    if v.sac is not None:
                        replay[v.name].append(v.sac.last_step.replay_ms)
            if gc_was:
                gc.collect()
    finally:
        if gc_was:
            gc.enable()

    # Numbers and ratios.
    base_t = times.get(NOCKPT) if NOCKPT not in failed else None
    ckpt_t = times.get(CKPT) if CKPT not in failed and CKPT in times else None
    base_peak = results.get(NOCKPT, {}).get("peak_bytes")
    ckpt_peak = results.get(CKPT, {}).get("peak_bytes") if results.get(CKPT, {}).get("status") == "ok" else None
    for v in runnable:
        res = results[v.name]
        if v.name in failed or not times[v.name]:
            continue
        t = times[v.name]
        res["step_ms"] = {k: (x * 1e3 if k != "n" else x) for k, x in _stats(t).items()}
        med = statistics.median(t)
        # Three views of the same ratio: paired per round (the headline), of the medians, and of the minima (other
        # processes only add time, so the minima are the least disturbed samples).
        if base_t:
            res["time_ratio_nockpt"] = statistics.median(a / b for a, b in zip(t, base_t))
            res["time_ratio_nockpt_of_medians"] = med / statistics.median(base_t)
            res["time_ratio_nockpt_of_mins"] = min(t) / min(base_t)
        if ckpt_t:
            res["time_ratio_ckpt"] = statistics.median(a / b for a, b in zip(t, ckpt_t))
            res["time_ratio_ckpt_of_medians"] = med / statistics.median(ckpt_t)
            res["time_ratio_ckpt_of_mins"] = min(t) / min(ckpt_t)
        if base_peak:
            res["peak_ratio_nockpt"] = res["peak_bytes"] / base_peak
        if ckpt_peak:
            res["peak_ratio_ckpt"] = res["peak_bytes"] / ckpt_peak
        if v.sac is not None:
            res["recompute_ms"] = statistics.median(replay[v.name])
            res["recompute_method"] = "measured: sac.last_step.replay_ms (median over timed steps)"
        elif v.name == NOCKPT:
            res["recompute_ms"] = 0.0
            res["recompute_method"] = "none (baseline)"
        elif base_t:
            res["recompute_ms"] = (med - statistics.median(base_t)) * 1e3
            res["recompute_method"] = "estimate: median step - median no-checkpoint step"
        if base_t and v.name != NOCKPT:
            res["overhead_ms_vs_nockpt"] = (med - statistics.median(base_t)) * 1e3
    for v in runnable:
        if v.sac is not None:
            v.sac.close()
    out["variants"] = results
    return out


# ----------------------------------------------------------------------------------------------------------------
# Long mode: training on real text
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Trainer:
    """One training run of the long mode: its own model copy and optimizer, and a step under some tool."""

    name: str
    label: str
    model: nn.Module
    step: Callable[[torch.Tensor], torch.Tensor]
    note: str = ""
    sac: Any = None


def _long_nockpt(ctx: dict[str, Any]) -> list[Trainer]:
    model = copy.deepcopy(ctx["base"])

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return [Trainer(NOCKPT, "no checkpointing", model, step)]


def _long_ckpt(ctx: dict[str, Any]) -> list[Trainer]:
    model = copy.deepcopy(ctx["base"])

    def step(ids: torch.Tensor) -> torch.Tensor:
        with checkpointed_blocks(list(model.model.layers)):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss

    return [Trainer(CKPT, "torch.utils.checkpoint per layer", model, step)]


def _long_tapesac(ctx: dict[str, Any]) -> list[Trainer]:
    """tapesac auto at the --memory-limit when the planner is built; policy "full" otherwise (said in the note)."""
    tapesac = ctx["tapesac"]
    model = copy.deepcopy(ctx["base"])
    note = ""
    try:
        sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="auto", memory_limit=ctx["memory_limit"])
        lim = ctx["memory_limit"]
        shown = f"{lim / MiB:.1f} MiB" if isinstance(lim, int) else repr(lim)
        name, label = "tapesac_auto", f"tapesac auto, memory_limit={shown}"
    except tapesac.ConfigError as e:
        sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full")
        name, label = "tapesac_full", 'tapesac policy="full"'
        note = f"auto: unavailable (planner not built: {str(e).split(';')[0]}); ran policy='full'"

    def step(ids: torch.Tensor) -> torch.Tensor:
        with sac.step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss

    return [Trainer(name, label, model, step, note=note, sac=sac)]


# The long mode's runs, in order (append a factory to add one). Each: dict(base, tapesac, memory_limit) -> Trainers.
LONG_VARIANT_FACTORIES: list[Callable[[dict[str, Any]], list[Trainer]]] = [_long_nockpt, _long_ckpt, _long_tapesac]


def _long_limit(args: argparse.Namespace, tapesac: Any, base: nn.Module, data: Any, size: Size) -> tuple[Any, str]:
    """tapesac auto's memory_limit in the long mode, and how it was chosen.

    --memory-limit when given. Otherwise on CUDA "90%" of device memory (where no checkpointing does not fit), and
    on CPU, where nothing runs out of memory, the step baseline (parameters, buffers) plus the peak halfway between
    full checkpointing's and no checkpointing's, measured on the first batch (a limit under which full
    checkpointing is the conventional choice and auto can spend the slack on keeping tensors)."""
    if args.memory_limit is not None:
        return args.memory_limit, "--memory-limit"
    if size.device.startswith("cuda"):
        return "90%", "default on CUDA"
    model = copy.deepcopy(base)
    ids = data.val_batches(1)[0]
    meter = PeakMeter(tapesac, cuda=False)

    def plain() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def ckpt() -> None:
        with checkpointed_blocks(list(model.model.layers)):
            model(input_ids=ids, labels=ids).loss.backward()

    peaks = {}
    for name, fn in (("nockpt", plain), ("ckpt", ckpt)):
        peaks[name] = meter.measure(fn)
        model.zero_grad(set_to_none=True)
    limit = _model_bytes(base) + peaks["ckpt"] + (peaks["nockpt"] - peaks["ckpt"]) // 2
    return limit, (f"parameters+buffers + halfway between ckpt's peak ({peaks['ckpt'] / MiB:.1f} MiB) and nockpt's "
                   f"({peaks['nockpt'] / MiB:.1f} MiB) on one batch, measured with {meter.method.split(' (')[0]}")


def run_long(args: argparse.Namespace, tapesac: Any, progress: Progress) -> dict[str, Any]:
    """--train-steps N: N AdamW steps on Austen, every run on the same batches, steps interleaved (rotating order)."""
    from .data import AustenData

    size = SIZES[args.train_size]
    data = AustenData(seq_len=size.seq, batch_size=size.batch, seed=args.seed)
    base = build_model("qwen3", size, seed=args.seed)
    limit, limit_note = _long_limit(args, tapesac, base, data, size)
    ctx = {"base": base, "tapesac": tapesac, "memory_limit": limit}
    trainers = [t for f in LONG_VARIANT_FACTORIES for t in f(ctx)]
    if args.train_variants:
        keep = set(args.train_variants.split(","))
        trainers = [t for t in trainers if t.name in keep or t.name.split("_")[0] in keep]
    opts = {t.name: torch.optim.AdamW(t.model.parameters(), lr=args.lr) for t in trainers}
    val = data.val_batches(args.val_batches)

    def val_loss(model: nn.Module) -> float:
        with torch.no_grad():
            return statistics.fmean(model(input_ids=b, labels=b).loss.item() for b in val)

    losses: dict[str, list[float]] = {t.name: [] for t in trainers}
    times: dict[str, list[float]] = {t.name: [] for t in trainers}
    replay: dict[str, list[float]] = {t.name: [] for t in trainers if t.sac is not None}
    step_peaks: dict[str, list[int]] = {t.name: [] for t in trainers if t.sac is not None}
    val0 = val_loss(base)
    t_start = time.perf_counter()
    for s in range(args.train_steps):
        ids = data.sample()
        k = s % len(trainers)
        for t in trainers[k:] + trainers[:k]:
            torch.manual_seed(args.seed + s)
            t0 = time.perf_counter()
            loss = t.step(ids)
            opts[t.name].step()
            opts[t.name].zero_grad(set_to_none=True)
            times[t.name].append(time.perf_counter() - t0)
            losses[t.name].append(loss.item())
            if t.sac is not None:
                replay[t.name].append(t.sac.last_step.replay_ms)
                mem = getattr(t.sac.last_step, "memory", None)
                if mem is not None:
                    step_peaks[t.name].append(int(mem.peak_bytes))
        if s % 5 == 0 or s + 1 == args.train_steps:
            progress(f"train: step {s + 1}/{args.train_steps}, loss " +
                     ", ".join(f"{n} {v[-1]:.3f}" for n, v in losses.items()))
    elapsed = time.perf_counter() - t_start
    ref = trainers[0].name
    runs = {}
    for t in trainers:
        tot = sum(times[t.name])
        runs[t.name] = {
            "label": t.label, "note": t.note, "total_s": tot,
            "median_step_ms": statistics.median(times[t.name]) * 1e3,
            "step_ms": {k: (x * 1e3 if k != "n" else x) for k, x in _stats(times[t.name]).items()},
            "loss": losses[t.name], "step_s": times[t.name],
            "val_loss_start": val0, "val_loss_end": val_loss(t.model),
            "losses_bitwise_equal_to_" + ref: losses[t.name] == losses[ref],
        }
        if t.sac is not None:
            runs[t.name]["median_replay_ms"] = statistics.median(replay[t.name])
            if step_peaks[t.name]:  # tapesac's own step peak (MemoryStats.peak_bytes: baseline included)
                runs[t.name]["max_step_peak_bytes"] = max(step_peaks[t.name])
                if isinstance(limit, int):
                    runs[t.name]["steps_over_limit"] = sum(p > limit for p in step_peaks[t.name])
            t.sac.close()
    for t in trainers:
        r = runs[t.name]
        r["total_ratio_nockpt"] = r["total_s"] / runs[ref]["total_s"] if ref == NOCKPT else None
        r["total_ratio_ckpt"] = r["total_s"] / runs[CKPT]["total_s"] if CKPT in runs else None
        # Paired per step (the runs took turns on the same batch): robust to load that comes and goes.
        for key, other in (("step_ratio_nockpt_paired", NOCKPT), ("step_ratio_ckpt_paired", CKPT)):
            if other in runs:
                r[key] = statistics.median(a / b for a, b in zip(times[t.name], times[other]))
    return {"steps": args.train_steps, "model": describe_model("qwen3", base), "size": args.train_size,
            "memory_limit": limit, "memory_limit_source": limit_note,
            "batch": size.batch, "seq": size.seq, "lr": args.lr, "optimizer": "AdamW", "corpus": data.describe(),
            "val_batches": args.val_batches, "wall_clock_s": elapsed, "runs": runs}


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    repo = Path(__file__).resolve().parents[2]

    def git(*a: str) -> str | None:
        for cwd in (Path.cwd(), repo):
            try:
                return subprocess.run(["git", *a], cwd=cwd, capture_output=True, text=True, timeout=10,
                                      check=True).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                continue
        return None

    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    status = git("status", "--porcelain")
    cuda = torch.cuda.is_available()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu: {cpu}",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def _fmt(x: Any, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(w: dict[str, Any]) -> str:
    lines = [f"\n{w['name']}: {w['description']}; batch {w['batch']} x seq {w['seq']}, {w['dtype']}, {w['device']}"]
    head = (f"  {'variant':<24}{'step ms':>9}{'IQR':>7}{'x nockpt':>9}{'x ckpt':>8}{'peak MiB':>10}{'x nockpt':>9}"
            f"{'x ckpt':>8}{'recompute ms':>14}  valid")
    lines.append(head)
    for name, r in w["variants"].items():
        if r["status"] != "ok":
            lines.append(f"  {name:<24}{r['status'].upper()}: {r.get('reason', '')}")
            continue
        t = r.get("step_ms", {})
        rec = r.get("recompute_ms")
        est = " est" if r.get("recompute_method", "").startswith("estimate") else ""
        rec_s = "-" if rec is None else f"{rec:.1f}{est}"
        val = r.get("validation", {})
        lines.append(
            f"  {name:<24}{_fmt(t.get('median'), '9.1f', '        -')}{_fmt(t.get('iqr'), '7.1f', '      -')}"
            f"{_fmt(r.get('time_ratio_nockpt'), '9.3f', '        -')}"
            f"{_fmt(r.get('time_ratio_ckpt'), '8.3f', '       -')}"
            f"{r['peak_bytes'] / MiB:10.1f}{_fmt(r.get('peak_ratio_nockpt'), '9.3f', '        -')}"
            f"{_fmt(r.get('peak_ratio_ckpt'), '8.3f', '       -')}{rec_s:>14}  {val.get('method', '')}"
            + ("" if r.get("within_limit", True) else "  PEAK OVER memory_limit")
        )
    return "\n".join(lines)


def plot_plane(report: dict[str, Any], path: str) -> None:
    """The memory/time plane: one panel per workload, x = step time / nockpt, y = peak MiB, every timed variant.

    Each variant has one marker (shape by tool: circle baseline, square PyTorch, diamond compile, triangle
    tapesac) and one colour in every panel; one legend names them (labels next to points overlap too often)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = report["workloads"]
    n = max(1, len(works))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols + 1.8, 4.2 * rows), squeeze=False)
    shapes = {"baseline": "o", "pytorch": "s", "compile": "D", "tapesac": "^"}
    names = list(dict.fromkeys(name for w in works for name, r in w["variants"].items()
                               if r["status"] == "ok" and "time_ratio_nockpt" in r))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    style = {name: (cmap(i % cmap.N),) for i, name in enumerate(names)}
    handles: dict[str, Any] = {}
    for ax, w in zip(axes.flat, works):
        for name, r in w["variants"].items():
            if name not in style or r["status"] != "ok" or "time_ratio_nockpt" not in r:
                continue
            x, y = r["time_ratio_nockpt"], r["peak_bytes"] / MiB
            h = ax.scatter([x], [y], color=style[name][0], marker=shapes.get(r["kind"], "o"), s=46, zorder=3,
                           edgecolors="black", linewidths=0.4)
            handles.setdefault(name, h)
        ax.set_title(f"{w['name']} (b{w['batch']}×s{w['seq']})", fontsize=9)
        ax.set_xlabel("step time / no checkpointing (median of paired rounds)", fontsize=8)
        ax.set_ylabel("peak memory above step entry (MiB)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(works):]:
        ax.axis("off")
    fig.legend([handles[nm] for nm in names], names, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(f"tapesac bench — {report['environment']['device']}; peak: {report['memory_method'].split(' (')[0]}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 1.7 / (5.0 * cols + 1.8), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_long(long: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in long["runs"].items():
        loss = r["loss"]
        k = 10
        smooth = [statistics.fmean(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
        a.plot(range(1, len(loss) + 1), smooth, label=f"{name} (val {r['val_loss_end']:.3f})", lw=1.2)
        cum = list(itertools_accumulate(r["step_s"]))
        b.plot(range(1, len(cum) + 1), cum, label=f"{name}: {r['total_s']:.0f} s", lw=1.2)
    a.set_xlabel("step")
    a.set_ylabel("train loss (mean of last 10 steps)")
    a.legend(fontsize=8)
    a.grid(True, alpha=0.3)
    b.set_xlabel("step")
    b.set_ylabel("cumulative step time (s)")
    b.legend(fontsize=8)
    b.grid(True, alpha=0.3)
    fig.suptitle(f"{long['steps']} steps on Austen — {long['model']}, batch {long['batch']}×seq {long['seq']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def itertools_accumulate(xs: Sequence[float]) -> Iterator[float]:
    total = 0.0
    for x in xs:
        total += x
        yield total


def format_long(long: dict[str, Any]) -> str:
    lines = [f"\nlong mode: {long['steps']} AdamW steps on {long['corpus']}", f"  {long['model']}, batch "
             f"{long['batch']} x seq {long['seq']}; steps interleaved (rotating order), same batches",
             f"  {'run':<16}{'total s':>9}{'x nockpt':>10}{'x ckpt':>8}{'median ms':>11}{'replay ms':>11}"
             f"{'loss 1':>8}{'loss N':>8}{'val end':>9}  curve"]
    for name, r in long["runs"].items():
        same = [v for k, v in r.items() if k.startswith("losses_bitwise_equal_to_")][0]
        lines.append(
            f"  {name:<16}{r['total_s']:9.1f}{_fmt(r['total_ratio_nockpt'], '10.3f', '         -')}"
            f"{_fmt(r['total_ratio_ckpt'], '8.3f', '       -')}{r['median_step_ms']:11.1f}"
            f"{_fmt(r.get('median_replay_ms'), '11.1f', '          -')}{r['loss'][0]:8.3f}{r['loss'][-1]:8.3f}"
            f"{r['val_loss_end']:9.3f}  {'identical' if same else 'DIFFERS'}")
        if r["note"]:
            lines.append(f"    note: {r['note']}")
        if "max_step_peak_bytes" in r:
            over = r.get("steps_over_limit")
            peak = r["max_step_peak_bytes"] / MiB
            lines.append(f"    tapesac step peak (telemetry, baseline included): max {peak:.1f} MiB"
                         + (f", {over} step(s) over the limit" if over is not None else ""))
    lim = long.get("memory_limit")
    if lim is not None:
        shown = f"{lim / MiB:.1f} MiB" if isinstance(lim, int) else repr(lim)
        lines.append(f"  tapesac auto memory_limit {shown}: {long.get('memory_limit_source', '')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tapesac bench",
        description="One training step of HF Qwen3 / Qwen3-MoE / Llama under no checkpointing, "
                    "torch.utils.checkpoint, PyTorch SAC, torch.compile's memory budget and tapesac, side by side.")
    p.add_argument("--models", default=",".join(ARCHS), help=f"comma-separated: {','.join(ARCHS)} (default all)")
    p.add_argument("--size", default=None,
                   help=f"comma-separated sizes: {','.join(SIZES)} (default: gpu1b with CUDA, else small,medium)")
    p.add_argument("--batch", type=int, default=None, help="override the size's batch")
    p.add_argument("--seq", type=int, default=None, help="override the size's sequence length")
    p.add_argument("--variants", default=None, help="comma-separated variant names to run (nockpt always runs)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds after validation (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads; 0 keeps torch's default (default: 1 on CPU, where a busy core stalls "
                        "every OpenMP barrier of a 2-thread step; torch's default with CUDA)")
    p.add_argument("--seed", type=int, default=0, help="weights, batch and step seed (default 0)")
    p.add_argument("--compile", action="store_true", help="run torch.compile on CPU too (slow: C++ kernels)")
    p.add_argument("--no-compile", action="store_true", help="never run torch.compile")
    p.add_argument("--compile-budgets", default="0.5", help="activation_memory_budget values (default 0.5)")
    p.add_argument("--auto-fractions", default="0.25,0.5,0.75",
                   help="tapesac auto limits as fractions from ckpt's peak to nockpt's (default 0.25,0.5,0.75)")
    p.add_argument("--smoke", action="store_true", help="tiny models, 3 rounds: well under a minute on CPU")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number and the environment as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the memory/time plane")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="run nothing: print the tables of a --json file and draw --plot / --train-plot from it")
    g = p.add_argument_group("long mode")
    g.add_argument("--train-steps", type=int, default=0,
                   help="train N steps on Austen (small Qwen3), ckpt vs tapesac; skips the step suite unless "
                        "--size is given")
    g.add_argument("--train-size", default="small", help="model size of the long mode (default small)")
    g.add_argument("--train-variants", default=None, help="runs of the long mode (default nockpt,ckpt,tapesac)")
    g.add_argument("--train-plot", default=None, metavar="PNG", help="loss curves and cumulative time")
    g.add_argument("--memory-limit", default=None,
                   help="tapesac auto's limit in the long mode (bytes, '2GiB', '90%%'; default: 90%% on CUDA; on CPU "
                        "halfway between full checkpointing's measured peak and no checkpointing's)")
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the long mode (default 1e-3)")
    g.add_argument("--val-batches", type=int, default=8, help="validation batches (persuasion) (default 8)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the suite (and the long mode); restores torch's thread count and determinism flag afterwards."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _replot(args: argparse.Namespace) -> int:
    report = json.loads(Path(args.from_json).read_text())
    for w in report.get("workloads", []):
        print(format_table(w))
    if report.get("long"):
        print(format_long(report["long"]))
    if args.plot and report.get("workloads"):
        plot_plane(report, args.plot)
        print(f"wrote {args.plot}")
    if args.train_plot and report.get("long"):
        plot_long(report["long"], args.train_plot)
        print(f"wrote {args.train_plot}")
    return 0


def _main(args: argparse.Namespace) -> int:
    if args.from_json:
        return _replot(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # cuBLAS is deterministic under use_deterministic_algorithms only with a fixed workspace, set before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import tapesac

    cuda = torch.cuda.is_available()
    if args.threads is None:
        args.threads = 0 if cuda else 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.rounds, args.warmup = min(args.rounds, 3), min(args.warmup, 1)
    if args.size is None:
        args.size = "smoke" if args.smoke else ("gpu1b" if cuda else ("" if args.train_steps else "small,medium"))
    sizes = [s.strip() for s in args.size.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"unknown --size {s!r}; expected one of {list(SIZES)}")
        if SIZES[s].device == "cuda" and not cuda:
            raise SystemExit(f"--size {s} needs CUDA (torch.cuda.is_available() is False); use small or medium")
    archs = [a.strip() for a in args.models.split(",") if a.strip()]
    for a in archs:
        if a not in ARCHS:
            raise SystemExit(f"unknown model {a!r} in --models; expected some of {list(ARCHS)}")

    progress = Progress(enabled=not args.quiet)
    env = environment()
    meter = PeakMeter(tapesac, cuda and any(SIZES[s].device == "cuda" for s in sizes))
    print(f"tapesac bench: torch {env['torch']}, transformers {env['transformers']}, {env['device']}, "
          f"{env['threads']} threads, git {(env['git_commit'] or 'none')[:10]}{' (dirty)' if env['git_dirty'] else ''}")
    if sizes:
        print(f"{args.rounds} timed rounds after {args.warmup} warm-up round(s), order rotating; peak memory: "
              f"{meter.method}")
    report: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "benchmark": "bench_step", "environment": env,
                              "args": vars(args), "memory_method": meter.method, "workloads": []}
    bad: list[str] = []
    t_all = time.perf_counter()
    for s in sizes:
        base_size = SIZES[s]
        size = dataclasses.replace(base_size, batch=args.batch or base_size.batch, seq=args.seq or base_size.seq)
        for arch in archs:
            progress(f"{s}/{arch}: building", force=True)
            model = build_model(arch, size, seed=args.seed)
            vocab = model.config.vocab_size
            gen = torch.Generator().manual_seed(args.seed + 1)
            ids = torch.randint(0, vocab, (size.batch, size.seq), generator=gen)  # [batch, seq]
            work = Workload(name=f"{s}/{arch}", arch=arch, size_name=s, size=size, model=model,
                            pristine=copy.deepcopy(model), ids=ids.to(size.device),
                            description=describe_model(arch, model))
            w = bench_workload(work, args, tapesac, meter, progress, VARIANT_FACTORIES)
            progress.done()
            print(format_table(w), flush=True)
            report["workloads"].append(w)
            for name, r in w["variants"].items():
                if r["status"] in ("invalid", "error") and not r.get("optional"):
                    bad.append(f"{w['name']}/{name}: {r['status']}: {r.get('reason', '')}")
            if w.get("unknown_variants"):
                bad.append(f"{w['name']}: --variants names no variant of the suite: {w['unknown_variants']} "
                           f"(known: {w['known_variants']})")
            del work, model
            gc.collect()
    if report["workloads"]:
        print("\n(step ms: median over rounds, IQR; x nockpt / x ckpt: median of per-round ratios to no checkpointing "
              "/ torch.utils.checkpoint; peak: bytes above step entry; recompute: tapesac measured replay time, "
              "'est' = median step - median no-checkpoint step)")
    if args.train_steps:
        progress("long mode: starting", force=True)
        report["long"] = run_long(args, tapesac, progress)
        progress.done()
        print(format_long(report["long"]))
        if args.train_plot:
            plot_long(report["long"], args.train_plot)
            print(f"wrote {args.train_plot}")
    report["elapsed_s"] = time.perf_counter() - t_all
    print(f"\n{report['elapsed_s']:.1f} s")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_jsonable(report), indent=1) + "\n")
        print(f"wrote {path}")
    if args.plot and report["workloads"]:
        plot_plane(report, args.plot)
        print(f"wrote {args.plot}")
    for b in bad:
        print(f"FAILED {b}", file=sys.stderr)
    return 1 if bad else 0
