"""A seeded generator of random blocks, and the check that runs one program with and without tapesac.

Contract: `Program.generate(seed)` is a pure function of the seed (its own `random.Random`, never the global RNG);
`build_model(program)` is deterministic given the program (weights are drawn under `torch.random.fork_rng`).
`check_program(seed)` runs the program once without tapesac and once per policy ("full", "none", a random set of
the ops the program records) on deep copies of one freshly built model, each run from the same torch seed, and
raises `ProgramFailure` (whose message prints the seed and the program) if the loss, any parameter gradient, the
input gradient, any buffer or the CPU RNG state after the step is not bitwise equal to the plain run.

A program is a stack of 2-3 blocks; each block is a list of `OpSpec`s applied to a running value `h` of shape
[B, T, D] (every op maps [B, T, D] -> [B, T, D], possibly non-contiguous), with a pool of earlier values (the
block input and every earlier op's output) that binary ops, in-place ops and `where` draw their second operand
from. In-place ops always mutate a fresh tensor (`h * c`) so that the program is valid under plain autograd.

Issue 18's families, drawn from a second RNG of the seed so that the programs above stay as they were apart from
the inserted ops: an *external kernel* op (an autograd.Function whose output buffer comes from an empty*-like
factory and is filled through `.numpy()` or ctypes, outside the dispatcher), *`.data` writes* at random points (in
the forward after a block, inside the backward when a block's output gradient arrives, or between two backward
passes) to a block's first weight or its input, and *step shapes* other than one `loss.backward()`: the same loss
backward twice (retain_graph), two losses backward in turn, `torch.autograd.grad` into `.grad`, and
`autograd.grad` then `backward`. A program with a `.data` write may be rejected with ReplayContractError (issue 18:
"recovered or rejected, never silent"); `Program.families()` names the families a program belongs to.

Issue 18 item 5: every program also runs policy "auto" (`AutoLimit`) under a memory_limit between the "full" and the
"none" peaks of its own runs (0, 0.3, 0.7 or all of the way), for two steps from one initial state (sometimes after a
forward-only step; a third of the programs run a third step, under the plan made after the first planned step, so
that re-plans are covered), in the program's step shape; the last step must be bitwise equal to the plain run (a
failure), and its memory outcome — within the limit, over it and flagged (`over_limit`), or refused with a
MemoryLimitError naming the limit — is counted by `tally()` (an unflagged step over the limit, any step, is a
failure).

Issue 19's replay schedules, from a third RNG of the seed: each program runs under one `Config.schedule`
("one_segment" the default, "planned", "hold_all", "lazy") and one backend ("eager" or "emulated_graph", the graph
backend's logic on CPU); "planned" and the emulated graph run warm-up steps first (undone before the compared step:
Program.warmup_steps), so that the schedules are planned and the graphs captured.

Issue 20's decision reuse (Note [Decisions reused]), from a fourth RNG: a program may run one warm-up step (undone)
before the compared one, on the same input (the compared step reuses the warm-up's keep/drop decisions) or on the
same values laid out with other strides (the first block's tape differs, so it is decided afresh). From a fifth, a
quarter of the programs record through at::RecordFunction instead of the dispatch hook (Program.hook, Note [Dispatch
hook]), and from a sixth a quarter save through autograd's Python saved-tensor hooks instead of tapesac's C++ ones
(Program.saved_hooks, Note [Saved tensors without Python] in python/bindings/saved_hooks.cpp): all must stay exact.

Reproduce one program: `cd tests/python && python3 -c "import random_program as R; R.check_program(SEED)"`;
print it: `print(R.Program.generate(SEED))`.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import random
import warnings
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------------
# Ops: name -> (make(block, key, d, args) creating parameters/buffers, apply(block, key, h, pool, args) -> h)
# ----------------------------------------------------------------------------------------------------------------------

UNARY = {
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": F.gelu, "silu": F.silu, "sin": torch.sin,
    "cos": torch.cos, "abs": torch.abs, "relu": torch.relu, "square": lambda h: h.square() * 0.5,
    "neg": torch.neg, "softplus": F.softplus, "exp_tanh": lambda h: torch.exp(torch.tanh(h)),
    "log1p_abs": lambda h: torch.log1p(h.abs()), "sqrt_abs1": lambda h: torch.sqrt(h.abs() + 1),
    "rsqrt_sq1": lambda h: torch.rsqrt(h.square() + 1), "erf": torch.erf, "atan": torch.atan, "elu": F.elu,
    "leaky_relu": lambda h: F.leaky_relu(h, 0.1), "hardtanh": F.hardtanh, "mish": F.mish,
    "clamp": lambda h: h.clamp(-1.0, 1.0), "logsigmoid": F.logsigmoid, "pow3": lambda h: h.pow(3) * 0.1,
    "reciprocal": lambda h: (h.abs() + 1).reciprocal(), "double_roundtrip": lambda h: h.double().sin().float(),
}

BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 1),
    "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2,
    "hypot": lambda a, b: torch.hypot(a, b) * 0.5, "lerp": lambda a, b: torch.lerp(a, b, 0.3),
    "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.2),
}

REDUCE = {
    "center": lambda h: h - h.mean(-1, keepdim=True),
    "sum_scale": lambda h: h * h.sum(-1, keepdim=True).tanh(),
    "softmax_d": lambda h: F.softmax(h, -1),
    "softmax_t": lambda h: F.softmax(h, 1),
    "log_softmax": lambda h: F.log_softmax(h, -1) * 0.2,
    "logsumexp": lambda h: h - torch.logsumexp(h, -1, keepdim=True),
    "amax": lambda h: h - h.amax(1, keepdim=True),
    "norm": lambda h: h / (h.norm(dim=-1, keepdim=True) + 1),
    "cumsum": lambda h: h.cumsum(1) * 0.3,
    "mean_t": lambda h: h + h.mean(1, keepdim=True),
    "sum_all": lambda h: h * torch.sigmoid(h.sum()),
    "prod": lambda h: h * torch.tanh(h).prod(-1, keepdim=True),
}


def _chunk(h):
    a, b = h.chunk(2, -1)
    return torch.cat([b * a.sigmoid(), a - b], -1)


def _split_rows(h):
    first, rest = h.split([1, h.shape[1] - 1], dim=1)
    return torch.cat([rest, first * 0.5], 1)


def _strided(h):
    a, b = h[..., ::2], h[..., 1::2]
    return torch.cat([a * b, a + b], -1)


def _unbind(h):
    return torch.stack(list(h.unbind(1))[::-1], 1) * 1.1


VIEW = {
    "flat_softmax": lambda h: h.reshape(h.shape[0], -1).softmax(-1).view(h.shape) * h.shape[1],
    "transpose": lambda h: h.transpose(0, 1).sigmoid().transpose(0, 1),
    "transpose_nc": lambda h: h.transpose(1, 2).contiguous().tanh().transpose(1, 2),  # non-contiguous result
    "permute": lambda h: h.permute(2, 0, 1).contiguous().sin().permute(1, 2, 0),
    "slice_cat": lambda h: torch.cat([h[..., h.shape[-1] // 2:], h[..., :h.shape[-1] // 2] * 2], -1),
    "strided": _strided,
    "expand": lambda h: h * h[:, :1, :].expand(h.shape).tanh(),
    "chunk": _chunk,
    "split": _split_rows,
    "unsqueeze_outer": lambda h: (h.unsqueeze(3) * h.unsqueeze(2).tanh()).mean(-1),
    "select": lambda h: h + h.select(1, 0).unsqueeze(1),
    "flip": lambda h: h.flip(-1) * 0.9,
    "roll": lambda h: torch.roll(h, 1, 1),
    "tril": lambda h: h.tril() + h.triu(1) * 0.5,
    "unbind": _unbind,
    "narrow": lambda h: torch.cat([h.narrow(1, 1, h.shape[1] - 1), h.narrow(1, 0, 1).exp()], 1),
    "view_flat": lambda h: h.reshape(-1).cumsum(0).view(h.shape) * 0.1,
    "diagonal": lambda h: h + h.diagonal(0, 1, 2).sum(-1, keepdim=True).unsqueeze(-1),
    "unfold": lambda h: h.unfold(-1, 2, 2).flip(-1).reshape(h.shape),
}


def _fresh(h: torch.Tensor, c: float) -> torch.Tensor:
    return h * c  # a new tensor whose grad_fn saves no tensor: safe to mutate


def _inplace(kind: str, h: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    t = _fresh(h, 1.25)
    k = max(1, t.shape[1] // 2)
    if kind == "add_":
        t.add_(p)
    elif kind == "mul_":
        t.mul_(p.sigmoid())
    elif kind == "relu_":
        t.relu_()
    elif kind == "tanh_":
        t.tanh_()
    elif kind == "clamp_":
        t.clamp_(-1.5, 1.5)
    elif kind == "copy_slice":
        t[:, :k].copy_(p[:, :k].tanh())
    elif kind == "setitem_strided":
        t[..., ::2] = p[..., 1::2]
    elif kind == "zero_of_view_":
        t = t.contiguous()  # t is fresh; a non-contiguous h gives a non-contiguous t, which .view() refuses
        t.view(t.shape[0], -1)[:, : t[0].numel() // 3].zero_()
    elif kind == "transpose_mul_":
        t.transpose(1, 2).mul_(q.transpose(1, 2))
    elif kind == "masked_fill_":
        t.masked_fill_(p > 0.5, 0.25)
    elif kind == "addcmul_":
        t.addcmul_(p, q, value=0.1)
    elif kind == "chain_":
        t.mul_(2).add_(q).sigmoid_()
    elif kind == "index_add_":
        idx = torch.arange(t.shape[-1] - 1, -1, -1, device=t.device) % max(1, t.shape[-1] - 1)
        t.index_add_(-1, idx, p, alpha=0.5)
    elif kind == "slice_then_base":
        t[:, 1:].mul_(3)
        t = t.tanh()
    else:
        raise KeyError(kind)
    return t


INPLACE = ["add_", "mul_", "relu_", "tanh_", "clamp_", "copy_slice", "setitem_strided", "zero_of_view_",
           "transpose_mul_", "masked_fill_", "addcmul_", "chain_", "index_add_", "slice_then_base"]

RANDOM = ["dropout", "dropout_module", "rand_mask", "randn_noise", "bernoulli", "sdpa_dropout", "alpha_dropout"]

MULTI = ["topk", "topk_scatter", "max_dim", "min_dim", "sort", "var_mean", "std_mean", "kthvalue", "aminmax",
         "median"]

NORM = ["layer_norm", "layer_norm_noaffine", "rms_norm", "rms_norm_f", "group_norm", "batch_norm"]

CATSTACK = ["stack_sum", "cat_linear", "cat_t_slice", "stack_weighted"]

WHERE = ["where", "masked_fill", "where_scalar"]

GATHER = ["gather", "index_select_d", "index_select_t", "adv_index", "take_along", "embedding"]

MATMUL = ["linear", "linear2d", "matmul_param", "bmm_attn", "einsum", "baddbmm", "sdpa"]

OTHER = ["no_grad_scale", "detach_mix", "residual", "custom_fn", "scalar_ops"]

EXOTIC = ["out_no_grad", "index_put_acc", "scatter_add", "diagonal_add_", "checkpoint", "masked_scatter",
          "as_strided", "clone_contig_inplace"]

CATEGORIES: dict[str, list[str]] = {
    "matmul": MATMUL,
    "unary": sorted(UNARY),
    "binary": sorted(BINARY),
    "reduce": sorted(REDUCE),
    "view": sorted(VIEW),
    "inplace": INPLACE,
    "random": RANDOM,
    "multi": MULTI,
    "norm": NORM,
    "catstack": CATSTACK,
    "where": WHERE,
    "gather": GATHER,
    "other": OTHER,
    "exotic": EXOTIC,
}
CATEGORY_WEIGHTS = {"matmul": 3, "unary": 3, "binary": 2, "reduce": 2, "view": 3, "inplace": 3, "random": 2,
                    "multi": 2, "norm": 1.5, "catstack": 1, "where": 1, "gather": 1.5, "other": 1.5,
                    "exotic": 2}


class _SwishFn(torch.autograd.Function):
    """A user-defined autograd Function: save_for_backward goes through the saved-tensor hooks too."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * (s + x * s * (1 - s))


def _empty_out(x: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(0, dtype=x.dtype)
    torch.empty(x.shape, out=buf)  # an out= buffer resized without setting its bytes
    return buf


# empty*-like factories of a float32 buffer shaped like a [B, T, D] float32 tensor (issue 18 item 1).
EXTERNAL_FACTORIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "empty": lambda x: torch.empty(x.shape),
    "empty_like": torch.empty_like,
    "new_empty": lambda x: x.new_empty(x.shape),
    "empty_strided_t": lambda x: torch.empty_strided(x.shape, (x.shape[1] * x.shape[2], 1, x.shape[1])),
    "empty_permuted": lambda x: torch.empty_permuted(x.shape, (2, 0, 1)),
    "empty_out": _empty_out,
}


def _external_fill(out: torch.Tensor, values: np.ndarray, how: str) -> None:
    """Writes `values` into `out` through its data pointer, as a kernel the dispatcher does not see."""
    if how == "numpy":
        out.numpy()[...] = values
        return
    src = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    for i, idx in enumerate(np.ndindex(*out.shape)):  # a strided C kernel, element by element
        off = sum(k * st for k, st in zip(idx, out.stride()))
        ctypes.memmove(out.data_ptr() + 4 * off, src.ctypes.data + 4 * i, 4)


class _ExternalKernelFn(torch.autograd.Function):
    """y = tanh(h) computed outside the dispatcher into an empty*-like float32 buffer, which is saved for backward."""

    @staticmethod
    def forward(ctx, h, factory: str, how: str):
        hf = h.detach().float().contiguous()
        out = EXTERNAL_FACTORIES[factory](hf)
        _external_fill(out, np.tanh(hf.numpy()), how)
        ctx.save_for_backward(out)
        return out.to(h.dtype)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return (g.float() * (1 - out * out)).to(g.dtype), None, None


# Operators registered outside aten (Program._with_custom_ops): one opaque op each to the recorder, whose kernel runs
# below autograd. "noise" and "noisy" draw from the default generator inside the kernel (Note [Random numbers drawn
# below a custom op], capture/src/recorder.cpp); "plain" draws nothing.
@torch.library.custom_op("tapesac_rp::noise", mutates_args=())
def _rp_noise(x: torch.Tensor) -> torch.Tensor:
    return torch.rand_like(x)


@_rp_noise.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tapesac_rp::noisy", mutates_args=())
def _rp_noisy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.rand_like(x)
    return x * r, r


@_rp_noisy.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _rp_noisy_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])  # the noise, an output of the op: "full" drops it and replays the op


_rp_noisy.register_autograd(lambda ctx, g, _gr: g * ctx.saved_tensors[0], setup_context=_rp_noisy_setup)


@torch.library.custom_op("tapesac_rp::scale", mutates_args=())
def _rp_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 1.5


@_rp_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_rp_scale.register_autograd(lambda ctx, g: g * 1.5)
CUSTOM_OPS = ("noise", "noisy", "plain")
# Program._with_session8_ops
SESSION8_OPS = ("native_dropout_zero", "cond_branch", "sparse_mix")
_SPARSE_MIX: dict[int, torch.Tensor] = {}


def _sparse_mix(t: int) -> torch.Tensor:
    """A fixed sparse (t, t) matrix: each position mixes itself and its predecessor."""
    if t not in _SPARSE_MIX:
        rows = torch.arange(t).repeat(2)
        cols = torch.cat([torch.arange(t), (torch.arange(t) - 1) % t])
        vals = torch.cat([torch.full((t,), 0.75), torch.full((t,), 0.25)])
        _SPARSE_MIX[t] = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (t, t),
                                                 check_invariants=False).coalesce()
    return _SPARSE_MIX[t]
# Seeds pinned by regression tests of test_random_programs.py (found by earlier runs; their docstrings describe those
# programs): a family added later leaves them as they were (Program._with_custom_ops).
PINNED_SEEDS = frozenset({
    5, 22, 52, 68, 71, 104, 137, 155, 236, 265, 273, 332, 471, 528, 577, 645, 685, 702, 724, 773, 820, 847, 865, 960,
    977, 989, 1034, 1220, 1272, 1336, 1353, 1440, 1509, 1527, 1651, 1843, 1846, 1981, 2091, 2123, 2141, 2206, 2218,
    2314, 2517, 2527, 2575, 2586, 2838, 3022, 3240, 3314, 3349, 3736, 3804, 4181, 4437, 4603, 4682})


@dataclass(frozen=True)
class OpSpec:
    """One op of a block: `kind` names it (see CATEGORIES), `j`/`k` index the pool, `p` is a small parameter."""

    kind: str
    j: int = 0
    k: int = 0
    p: float = 0.0
    flag: bool = False

    def __str__(self) -> str:
        extra = []
        if self.kind in _USES_POOL:
            extra.append(f"j={self.j}")
            if self.kind in _USES_POOL2:
                extra.append(f"k={self.k}")
        if self.p:
            extra.append(f"p={self.p:g}")
        if self.kind == "external_kernel":
            extra.append(list(EXTERNAL_FACTORIES)[self.k % len(EXTERNAL_FACTORIES)])
            extra.append("ctypes" if self.flag else "numpy")
        elif self.kind == "custom_op":
            extra.append(CUSTOM_OPS[self.k % len(CUSTOM_OPS)])
        elif self.flag:
            extra.append("flag")
        return f"{self.kind}({', '.join(extra)})" if extra else self.kind


_USES_POOL = set(BINARY) | set(INPLACE) | {"stack_sum", "cat_linear", "cat_t_slice", "stack_weighted", "where",
                                           "masked_fill", "residual", "where_scalar"}
_USES_POOL2 = {"transpose_mul_", "addcmul_", "chain_", "where"}


DATA_WRITE_POINTS = ("forward", "backward", "between")
STEP_SHAPES = ("backward", "retain_twice", "two_losses", "autograd_grad", "grad_then_backward")
# Drawn by Program._with_batched_backward from its own RNG (the shapes above keep their draws).
BATCHED_SHAPE = "grads_batched"
# Drawn by Program._with_double_backward from its own RNG: a gradient penalty (create_graph=True, then a backward
# through the gradients), so the first backward's unpacked tensors stay referenced by the second's graph.
DOUBLE_SHAPE = "double_backward"
SCHEDULES = ("one_segment", "planned", "hold_all", "lazy")  # Config.schedule
WARMUPS = ("none", "same", "strided")  # Program.warmup (issue 20)
HOOKS = ("dispatch_key", "record_function")  # Program.hook (issue 20: Note [Dispatch hook])
SAVED_HOOKS = ("cpp", "python")  # Program.saved_hooks (issue 20: Note [Saved tensors without Python])
BACKENDS = ("eager", "emulated_graph")
TWO_PASS_SHAPES = ("retain_twice", "two_losses", "grad_then_backward")


@dataclass(frozen=True)
class DataWrite:
    """A `.data` write (the version counter does not move) of `target` of block `block` — "weight" (its first
    Linear's weight) or "input" (the tensor the block was called with) — scaled by `factor`, made `where`:
    "forward" right after the block's forward, "backward" when the gradient of the block's output arrives (before
    the block's backward), "between" between the step's two backward passes; a refill also "split" (freed after the
    forward, refilled when the gradient of the block's output arrives)."""

    where: str
    block: int
    target: str
    factor: float
    replace: bool = False  # `.data = .data * factor`: a new storage (Program._with_data_replacements)
    refill: int = 0  # freed and refilled in `refill` row slices, then `*= factor` (Program._with_refills)

    def __str__(self) -> str:
        if self.refill:
            return (f"{self.target}[{self.block}] freed, refilled in {self.refill} slice(s), *= {self.factor:g} "
                    f"({self.where})")
        if self.replace:
            return f"{self.target}[{self.block}].data = .data * {self.factor:g} ({self.where})"
        return f"{self.target}[{self.block}].data *= {self.factor:g} ({self.where})"


@dataclass(frozen=True)
class ModuleHook:
    """A user's forward hook on block `block` (Program._with_module_hooks): a pre-hook that scales the block's input
    (`kind` "pre") or a hook that scales its output ("post"), registered with `prepend`, either when the model is
    built (`inside` False: before tapesac's step hooks, which go last) or right before the block's call inside the step
    (after them) and removed after it."""

    block: int
    kind: str
    prepend: bool
    inside: bool
    factor: float

    def __str__(self) -> str:
        where = "in the step" if self.inside else "at build"
        return f"{self.kind}-hook on block {self.block} (prepend={self.prepend}, {where}) *= {self.factor:g}"


@dataclass(frozen=True)
class Program:
    seed: int
    shape: tuple[int, int, int]  # B, T, D
    blocks: tuple[tuple[OpSpec, ...], ...]
    stem: bool  # a Linear before the blocks (block 0's input is then a non-leaf)
    input_grad: bool
    contract: str
    op_set_seed: int
    repeat_first: bool = False  # blocks[0] is called again on the output: two tapes of one module in a step
    tuple_out: bool = False  # every block returns (h, aux); the model adds 0.1 * aux outside the blocks
    autocast: bool = False  # the forward runs under torch.autocast("cpu", dtype=torch.bfloat16)
    step: str = "backward"  # STEP_SHAPES: how the step's backward runs
    data_writes: tuple[DataWrite, ...] = ()
    schedule: str = "one_segment"  # SCHEDULES: TapeSAC(schedule=...)
    backend: str = "eager"  # BACKENDS: TapeSAC(backend=...)
    warmup: str = "none"  # WARMUPS: a warm-up step before the compared one (issue 20, Note [Decisions reused])
    hook: str = "dispatch_key"  # HOOKS: how the recorder sees operator calls (Note [Dispatch hook])
    saved_hooks: str = "cpp"  # SAVED_HOOKS: how autograd hands tapesac its saved tensors
    module_hooks: tuple[ModuleHook, ...] = ()  # Program._with_module_hooks

    @staticmethod
    def generate(seed: int, min_ops: int = 4, max_ops: int = 10) -> "Program":
        rng = random.Random(seed)
        b = rng.choice([1, 2, 3])
        t = rng.choice([3, 4, 6])
        d = rng.choice([4, 6, 8])
        cats = list(CATEGORY_WEIGHTS)
        weights = [CATEGORY_WEIGHTS[c] for c in cats]
        blocks = []
        for _ in range(rng.choice([2, 2, 3])):
            # Every block starts with an op that saves a block intermediate (linear, then tanh saves its output),
            # so that policy "full" has something to drop and replay in every block.
            ops = [OpSpec("linear", flag=rng.random() < 0.7), OpSpec("unary_tanh")]
            for i in range(rng.randint(min_ops, max_ops)):
                pool_size = len(ops) + 1  # the block input and every op output so far
                cat = rng.choices(cats, weights)[0]
                kind = rng.choice(CATEGORIES[cat])
                if cat in ("unary", "binary", "reduce", "view"):
                    kind = f"{cat}_{kind}"
                p = 0.0
                if cat == "random":
                    p = rng.choice([0.1, 0.3, 0.5])
                elif kind in ("topk", "topk_scatter", "kthvalue"):
                    p = float(rng.randint(1, d))
                ops.append(OpSpec(kind, j=rng.randrange(pool_size), k=rng.randrange(pool_size), p=p,
                                  flag=rng.random() < 0.5))
            if rng.random() < 0.5:
                ops.append(OpSpec("residual", j=0))
            blocks.append(tuple(ops))
        program = Program(seed=seed, shape=(b, t, d), blocks=tuple(blocks), stem=rng.random() < 0.5,
                          input_grad=rng.random() < 0.7, contract=rng.choice(["check", "check", "strict", "off"]),
                          op_set_seed=rng.randrange(2**31), repeat_first=rng.random() < 0.15,
                          tuple_out=rng.random() < 0.15, autocast=rng.random() < 0.1)
        return (program._with_issue18_families()._with_issue19_schedules()._with_issue20_warmup()
                ._with_input_writes()._with_batched_backward()._with_double_backward()._with_saved_data_writes()
                ._with_entry_writes()._with_data_replacements()._with_refills()._with_retries()._with_self_calls()
                ._with_module_hooks()._with_custom_ops()._with_session8_ops())

    def _with_issue18_families(self) -> "Program":
        """Issue 18's families, from their own RNG (the programs above are unchanged but for inserted ops)."""
        rng = random.Random(f"issue18-{self.seed}")
        blocks = []
        for ops in self.blocks:
            ops = list(ops)
            if rng.random() < 0.2:  # an external kernel after the block's first two ops
                at = rng.randint(2, len(ops))
                ops.insert(at, OpSpec("external_kernel", k=rng.randrange(len(EXTERNAL_FACTORIES)),
                                      flag=rng.random() < 0.3))
            blocks.append(tuple(ops))
        step = "backward" if rng.random() < 0.7 else rng.choice(STEP_SHAPES[1:])
        writes = []
        two_pass = step in TWO_PASS_SHAPES
        if rng.random() < (0.5 if two_pass else 0.15):
            where = "between" if two_pass and rng.random() < 0.5 else rng.choice(["forward", "backward"])
            writes.append(DataWrite(where=where, block=rng.randrange(len(blocks)),
                                    target=rng.choice(["weight", "input"]), factor=rng.choice([0.5, 1.5, -1.0])))
        # contract="off" preserves nothing: a .data write is then silently wrong by design (README), not a hole.
        contract = "check" if writes and self.contract == "off" else self.contract
        return dataclasses.replace(self, blocks=tuple(blocks), step=step, data_writes=tuple(writes),
                                   contract=contract)

    def _with_issue19_schedules(self) -> "Program":
        """Issue 19's replay schedules and the emulated graph backend, from their own RNG (the programs above are
        unchanged)."""
        rng = random.Random(f"issue19-{self.seed}")
        schedule = rng.choices(SCHEDULES, [4, 2, 2, 2])[0]
        backend = "emulated_graph" if rng.random() < 0.3 else "eager"
        return dataclasses.replace(self, schedule=schedule, backend=backend)

    def _with_issue20_warmup(self) -> "Program":
        """Issue 20's decision reuse, from its own RNG: a warm-up step on the same input (the compared step reuses the
        warm-up's keep/drop decisions) or on the input laid out with other strides (the first block's tape differs:
        decided afresh)."""
        rng = random.Random(f"issue20-{self.seed}")
        warmup = rng.choices(WARMUPS, [5, 3, 2])[0]
        hook = "record_function" if random.Random(f"issue20-hook-{self.seed}").random() < 0.25 else "dispatch_key"
        saved = "python" if random.Random(f"issue20-saved-hooks-{self.seed}").random() < 0.25 else "cpp"
        return dataclasses.replace(self, warmup=warmup, hook=hook, saved_hooks=saved)

    def _with_input_writes(self) -> "Program":
        """Blocks that write their own input in place before reading it (from their own RNG): the first block's input
        is the data batch (no grad: its old bytes are gone, the written value is kept) or the stem's output, later
        blocks' the previous block's output; with the first block called again (repeat_first) one tape runs on both
        kinds of input, so its calls differ in what no replay can rebuild (Note [One tape, several must-keep
        patterns], runtime/src/auto_planner.cpp; found by an adversarial test as an internal ConfigError)."""
        rng = random.Random(f"input-writes-{self.seed}")
        if rng.random() >= 0.2:
            return self
        blocks = [list(ops) for ops in self.blocks]
        for i in range(len(blocks)):
            if i == 0 or rng.random() < 0.3:
                blocks[i].insert(0, OpSpec("input_inplace", p=rng.choice([0.5, 1.5, -1.0])))
        return dataclasses.replace(self, blocks=tuple(tuple(ops) for ops in blocks),
                                   repeat_first=self.repeat_first or rng.random() < 0.5)

    def _with_batched_backward(self) -> "Program":
        """A plain backward turned into autograd.grad(..., is_grads_batched=True) (from its own RNG): autograd runs it
        under vmap, and the replays inside it (Note [Replay outside the backward's transforms])."""
        if self.step != "backward" or self.data_writes or random.Random(f"batched-{self.seed}").random() >= 0.08:
            return self
        return dataclasses.replace(self, step=BATCHED_SHAPE)

    def _with_double_backward(self) -> "Program":
        """A plain backward turned into a gradient penalty (from its own RNG): autograd.grad with create_graph=True,
        then backward of loss + 0.1 * sum(g^2). The second backward reads the first one's unpacked (replayed) tensors
        again, saved in its graph; with a repeated first block the replay of one call overwrote, on the emulated
        graph, the static buffer another call's replay had handed out (Note [Static memory]; an independent fuzzer's
        case, hold_all). Half of these call the first block twice. Not with external kernels (their backward is not
        differentiable) nor attention (CPU SDPA has no double backward)."""
        rng = random.Random(f"double-{self.seed}")
        no_double = {"external_kernel", "sdpa", "custom_op"}
        if self.step != "backward" or self.data_writes or no_double & set(self.ops()) or rng.random() >= 0.1:
            return self
        return dataclasses.replace(self, step=DOUBLE_SHAPE, repeat_first=self.repeat_first or rng.random() < 0.5)

    def _with_saved_data_writes(self) -> "Program":
        """A `.data` write inside a block's forward to one of the block's own intermediates, after a later op may have
        saved it (from its own RNG): the version counter does not move, so a backward without tapesac reads the
        written bytes (Note [Written after its save], replay/src/decide.cpp; an independent fuzzer's case, replayed
        from before the write under policy full and contract "check")."""
        rng = random.Random(f"saved-data-write-{self.seed}")
        if rng.random() >= 0.12:
            return self
        blocks = [list(ops) for ops in self.blocks]
        i = rng.randrange(len(blocks))
        first = 1 if blocks[i][0].kind == "input_inplace" else 0
        at = rng.randint(first + 3, len(blocks[i]))  # after the first linear and tanh (and a third op)
        # k: how — 0 `.data.mul_`, 1 `.data = .data * p` (a new storage), 2 `untyped_storage().copy_` (dispatched
        # as set_ on a Storage, then copy_), 3 `.data.set_(another value's .data)` (leaves the value as it was).
        blocks[i].insert(at, OpSpec("data_write_saved", j=rng.randint(first + 1, at), k=rng.choice([0, 0, 1, 2, 3]),
                                    p=rng.choice([0.5, 1.5, -1.0])))
        return dataclasses.replace(self, blocks=tuple(tuple(ops) for ops in blocks))

    def _with_data_replacements(self) -> "Program":
        """Some `.data` writes become replacements, `t.data = t.data * factor` (from their own RNG): a new storage, no
        version moves. Autograd saves a leaf (the weight) or a block input that is not the saving op's output as the
        tensor itself, so a backward without tapesac reads the new data (Note [Saved as itself],
        replay/src/block_call_replay.cpp; an independent fuzzer: other gradients under every policy before)."""
        rng = random.Random(f"data-replace-{self.seed}")
        if self.data_writes or rng.random() >= 0.08:  # a program of its own: the others' writes stay as they were
            return self
        two_pass = self.step in TWO_PASS_SHAPES
        where = "between" if two_pass and rng.random() < 0.5 else rng.choice(["forward", "backward"])
        write = DataWrite(where=where, block=rng.randrange(len(self.blocks)), target=rng.choice(["weight", "input"]),
                          factor=rng.choice([0.5, 1.5, -1.0]), replace=True)
        return dataclasses.replace(self, data_writes=(write,),
                                   contract="check" if self.contract == "off" else self.contract)

    def _with_refills(self) -> "Program":
        """A block's weight freed and refilled as FSDP2 does around its backward (untyped_storage().resize_(0), then
        resize_(n), at the allocator's choice of address, and the same values copied back), in 1-3 row slices — both
        right after the block's forward, both before its backward, or "split": freed after the forward, refilled
        before the backward (FSDP2's order) —, then maybe written for real
        (`*= factor`, 1.0: none); from its own RNG, in programs of their own. The reallocation is no operator call: writes into bytes not
        written since refill them (Note [a storage reallocated unseen], replay/src/preserve.cpp; the second slice's
        bytes before the write — fresh memory — were restored for the replay before)."""
        rng = random.Random(f"refill-{self.seed}")
        if self.data_writes or rng.random() >= 0.08:
            return self
        wheres = ["forward", "backward"] + ([] if self.repeat_first else ["split"])  # split: the block runs once
        write = DataWrite(where=rng.choice(wheres), block=rng.randrange(len(self.blocks)),
                          target="weight", factor=rng.choice([1.0, 1.0, 0.5, -1.0]), refill=rng.choice([1, 2, 3]))
        return dataclasses.replace(self, data_writes=(write,),
                                   contract="check" if self.contract == "off" else self.contract)

    def _with_retries(self) -> "Program":
        """A block whose forward raises part-way on its first call of each forward, caught by the model, which calls it
        again (a kernel or out-of-memory fallback); from its own RNG. The partial call's graph dies with the exception
        (Note [A block call whose forward raised], replay/src/block_call.cpp: observed by the planner like a complete
        call, it made "auto" refuse a limit at the no-checkpoint peak)."""
        rng = random.Random(f"retry-{self.seed}")
        if self.data_writes or rng.random() >= 0.06:  # programs with writes stay as they were (regression seeds)
            return self
        i = rng.randrange(len(self.blocks))
        ops = list(self.blocks[i])
        if ops[0].kind == "input_inplace":  # a retry would write the block's input twice
            return self
        ops.insert(rng.randint(2, len(ops)), OpSpec("raise_once"))
        blocks = list(self.blocks)
        blocks[i] = tuple(ops)
        return dataclasses.replace(self, blocks=tuple(blocks))

    def _with_self_calls(self) -> "Program":
        """A block that calls itself once part-way (a recursive module: its inner call records into the outer one),
        with the rest of its forward — the inner call included — under the user's own saved_tensors_hooks when the
        op's flag is set (a lossy fp16 pack, as an offload or compression hook); from its own RNG. The inner call's
        post-hook closed the outer block call and popped the user's hooks instead of tapesac's (Note [A block that
        calls itself], python/tapesac/hooks.py: gradients off by 3.3e-3 under every policy)."""
        rng = random.Random(f"self-call-{self.seed}")
        if self.data_writes or "raise_once" in self.ops() or rng.random() >= 0.06:
            return self
        i = rng.randrange(len(self.blocks))
        ops = list(self.blocks[i])
        if ops[0].kind == "input_inplace":  # the inner call would write the outer call's input
            return self
        ops.insert(rng.randint(1, len(ops)), OpSpec("self_call", flag=rng.random() < 0.7))
        blocks = list(self.blocks)
        blocks[i] = tuple(ops)
        return dataclasses.replace(self, blocks=tuple(blocks))

    def _with_module_hooks(self) -> "Program":
        """The user's own forward pre-hooks and hooks on blocks (from their own RNG), registered before tapesac's step
        hooks or after them, prepended or not: a hook ordered before tapesac's pre-hook (or after its post-hook) runs
        outside the block call, one between them inside it, recorded. tapesac writes its hooks into the modules' hook
        dicts (Note [Block hooks without handles], python/tapesac/hooks.py): the order must be register_*'s."""
        rng = random.Random(f"module-hooks-{self.seed}")
        if rng.random() >= 0.12:
            return self
        hooks = tuple(ModuleHook(block=rng.randrange(len(self.blocks)), kind=rng.choice(["pre", "post"]),
                                 prepend=rng.random() < 0.5, inside=rng.random() < 0.5,
                                 factor=rng.choice([0.5, 1.5, -1.0])) for _ in range(rng.randint(1, 3)))
        return dataclasses.replace(self, module_hooks=hooks)

    def _with_custom_ops(self) -> "Program":
        """An operator registered outside aten (CUSTOM_OPS) inserted after a block's first two ops (from its own RNG).
        Two of the three draw random numbers inside their kernel, unseen by the recorder: before 2026-12-07 their
        replay drew new numbers (an adversarial test; Note [Random numbers drawn below a custom op])."""
        if self.seed in PINNED_SEEDS:
            return self
        rng = random.Random(f"custom-ops-{self.seed}")
        blocks = []
        for ops in self.blocks:
            ops = list(ops)
            if rng.random() < 0.1:
                ops.insert(rng.randint(2, len(ops)), OpSpec("custom_op", k=rng.randrange(len(CUSTOM_OPS))))
            blocks.append(tuple(ops))
        return dataclasses.replace(self, blocks=tuple(blocks))

    def _with_session8_ops(self) -> "Program":
        """One of SESSION8_OPS inserted after a block's first two ops (from its own RNG), each a family helpers found
        failing on 2026-12-07: `native_dropout` at p=0 in training draws from the generator although it keeps every
        element (replayed as deterministic, it moved the generator in the backward); `torch.cond`, a Python
        higher-order operator (torch's untyped "could not find kernel" under the dispatch hook); a sparse matrix read
        by the block (the graph backend's static buffers crashed on it)."""
        # Plain PyTorch runs neither under vmap (a batched backward: torch.cond's and sparse mm's backward have no
        # batching rule) nor sparse mm's double backward.
        if self.seed in PINNED_SEEDS or self.step in (BATCHED_SHAPE, DOUBLE_SHAPE):
            return self
        rng = random.Random(f"session8-{self.seed}")
        blocks = []
        for ops in self.blocks:
            ops = list(ops)
            if rng.random() < 0.08:
                ops.insert(rng.randint(2, len(ops)), OpSpec(rng.choice(SESSION8_OPS)))
            blocks.append(tuple(ops))
        return dataclasses.replace(self, blocks=tuple(blocks))

    def _with_entry_writes(self) -> "Program":
        """A `.data` write to a block's input at its entry — the previous block's output, which that block may have
        saved and tapesac dropped — with no reference to it kept afterwards (from its own RNG). Autograd's saved
        tensor is that storage: its backward reads the written bytes (Note [A dropped value on a live storage],
        replay/src/block_call_replay.cpp; adversarial tests: a pre-hook's `args[0].data.mul_(2)`)."""
        rng = random.Random(f"entry-write-{self.seed}")
        if self.data_writes or len(self.blocks) < 2 or rng.random() >= 0.12:
            return self
        write = DataWrite(where="entry", block=rng.randrange(1, len(self.blocks)), target="input",
                          factor=rng.choice([0.5, 1.5, -1.0]))
        # contract="off" watches no write: such a write is then silently wrong by design (README).
        return dataclasses.replace(self, data_writes=(write,),
                                   contract="check" if self.contract == "off" else self.contract)

    def warmup_steps(self) -> int:
        """Steps run (and undone) before the compared one: 'planned' plans its schedules after a step, and the
        emulated graph captures on a later step than the first; a drawn warm-up (WARMUPS) is at least one step."""
        steps = 2 if self.backend == "emulated_graph" else 1 if self.schedule == "planned" else 0
        return max(steps, 0 if self.warmup == "none" else 1)

    def families(self) -> list[str]:
        """The issue 18 families this program belongs to ("plain" when none)."""
        out = []
        if "external_kernel" in self.ops():
            out.append("external_kernel")
        if "custom_op" in self.ops():
            out.append("custom_op")
        if "input_inplace" in self.ops():
            out.append("input_inplace" + (":repeated" if self.repeat_first and self.blocks[0][0].kind == "input_inplace"
                                          else ""))
        out += [f"data_write:{w.where}" for w in self.data_writes]
        if any(w.replace for w in self.data_writes):
            out.append("data_write:replace")
        if any(w.refill for w in self.data_writes):
            out.append("data_write:refill")
        if "data_write_saved" in self.ops():
            out.append("data_write:saved")
        if "raise_once" in self.ops():
            out.append("block_retry")
        if "self_call" in self.ops():
            out.append("self_call")
        out += sorted({f"module_hook:{h.kind}:{'inside' if h.inside else 'built'}" for h in self.module_hooks})
        if self.step != "backward":
            out.append(f"step:{self.step}")
        return out or ["plain"]

    def ops(self) -> list[str]:
        return [op.kind for blk in self.blocks for op in blk]

    def __str__(self) -> str:
        lines = [f"Program(seed={self.seed}, shape[B,T,D]={list(self.shape)}, stem={self.stem}, "
                 f"input_grad={self.input_grad}, contract={self.contract!r}, repeat_first={self.repeat_first}, "
                 f"tuple_out={self.tuple_out}, autocast={self.autocast}, step={self.step!r}, "
                 f"schedule={self.schedule!r}, backend={self.backend!r}, warmup={self.warmup!r}, "
                 f"hook={self.hook!r}, saved_hooks={self.saved_hooks!r})"]
        for i, blk in enumerate(self.blocks):
            lines.append(f"  block {i}: " + " -> ".join(str(op) for op in blk))
        for w in self.data_writes:
            lines.append(f"  write: {w}")
        for h in self.module_hooks:
            lines.append(f"  hook: {h}")
        return "\n".join(lines)


def _base(kind: str) -> str:
    for cat in ("unary", "binary", "reduce", "view"):
        if kind.startswith(cat + "_"):
            return cat
    return kind


class RandomBlock(nn.Module):
    """Runs one block's OpSpecs. Parameters and index buffers are created per op at construction."""

    def __init__(self, ops: tuple[OpSpec, ...], shape: tuple[int, int, int], tuple_out: bool = False):
        super().__init__()
        self.ops = ops
        self.tuple_out = tuple_out
        b, t, d = shape
        self.mods = nn.ModuleDict()
        self.params = nn.ParameterDict()
        for i, op in enumerate(ops):
            key = str(i)
            kind = op.kind
            if kind in ("linear", "linear2d"):
                self.mods[key] = nn.Linear(d, d, bias=op.flag)
            elif kind in ("matmul_param", "einsum"):
                self.params[key] = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
            elif kind == "baddbmm":
                self.params[key] = nn.Parameter(torch.randn(b, t, t) * 0.1)
            elif kind == "cat_linear":
                self.mods[key] = nn.Linear(2 * d, d)
            elif kind == "stack_weighted":
                self.params[key] = nn.Parameter(torch.randn(2))
            elif kind == "layer_norm":
                self.mods[key] = nn.LayerNorm(d)
            elif kind == "rms_norm":
                self.mods[key] = nn.RMSNorm(d)
            elif kind == "group_norm":
                self.mods[key] = nn.GroupNorm(2, d)
            elif kind == "batch_norm":
                self.mods[key] = nn.BatchNorm1d(d)  # running stats: external state replay must never re-update
            elif kind == "dropout_module":
                self.mods[key] = nn.Dropout(op.p)
            elif kind == "embedding":
                self.params[key] = nn.Parameter(torch.randn(d, d) * 0.3)
            if kind in ("gather", "take_along", "embedding"):
                self.register_buffer(f"idx{i}", torch.randint(0, d, (b, t, d)))
            elif kind == "index_select_d":
                self.register_buffer(f"idx{i}", torch.randperm(d))
            elif kind in ("index_select_t", "adv_index"):
                self.register_buffer(f"idx{i}", torch.randint(0, t, (t,)))  # duplicates: accumulating backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        pool = [x]
        with contextlib.ExitStack() as user_hooks:  # Program._with_self_calls: the user's hooks, from the self call on
            for i, op in enumerate(self.ops):
                if op.kind == "self_call":
                    h = self._self_call(h, op, user_hooks)
                else:
                    h = _apply(self, str(i), i, op, h, pool)
                pool.append(h)
        if self.tuple_out:
            return h, pool[len(pool) // 2]
        return h

    def _self_call(self, h: torch.Tensor, op: OpSpec, user_hooks: contextlib.ExitStack) -> torch.Tensor:
        """Program._with_self_calls: the block calls itself (once: the inner call skips this op)."""
        if getattr(self, "in_self_call", False):
            return h
        if op.flag:
            user_hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(_lossy_pack, _lossy_unpack))
        self.in_self_call = True
        try:
            inner = self(h * 0.5)
        finally:
            self.in_self_call = False
        return h + 0.25 * (inner[0] if isinstance(inner, tuple) else inner)


def _lossy_pack(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The user's saved-tensor pack of Program._with_self_calls: fp32 tensors saved in fp16 (lossy, like a compressing
    or offloading hook), others as they are."""
    if t.dtype == torch.float32:
        return t.half(), True
    return t, False


def _lossy_unpack(packed: tuple[torch.Tensor, bool]) -> torch.Tensor:
    t, cast = packed
    return t.float() if cast else t


class _BlockRetry(RuntimeError):
    """Raised part-way through a block's first call of a forward (Program._with_retries); the model calls it again."""


def _apply(blk: RandomBlock, key: str, i: int, op: OpSpec, h: torch.Tensor, pool: list[torch.Tensor]) -> torch.Tensor:
    kind = op.kind
    if kind == "raise_once":
        if getattr(blk, "armed", False):
            blk.armed = False
            raise _BlockRetry("part-way through the block")
        return h
    if kind == "data_write_saved":  # Program._with_saved_data_writes: the block's own intermediate, no version move
        t = pool[op.j % len(pool)]
        if op.k == 1:
            t.data = t.data * op.p
        elif op.k == 2:
            t.untyped_storage().copy_((t.detach() * op.p).contiguous().untyped_storage()) if t.is_contiguous() \
                and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes else t.data.mul_(op.p)
        elif op.k == 3:
            src = pool[max(0, op.j - 1)]
            if src.dtype == t.dtype:  # set_ refuses another dtype (autocast mixes bf16 and fp32)
                t.data.set_(src.data)
        else:
            t.data.mul_(op.p)
        return h
    base = _base(kind)
    p = pool[op.j % len(pool)]
    q = pool[op.k % len(pool)]
    if p.dtype != h.dtype:  # autocast: pool values may be bf16 or fp32
        p = p.to(h.dtype)
    if q.dtype != h.dtype:
        q = q.to(h.dtype)
    if base == "unary":
        return UNARY[kind[len("unary_"):]](h)
    if base == "binary":
        return BINARY[kind[len("binary_"):]](h, p)
    if base == "reduce":
        return REDUCE[kind[len("reduce_"):]](h)
    if base == "view":
        return VIEW[kind[len("view_"):]](h)
    if kind in INPLACE:
        return _inplace(kind, h, p, q)
    if kind == "input_inplace":  # op 0: the block writes its input in place (Program._with_input_writes)
        if not (h.is_leaf and h.requires_grad):  # a leaf that requires grad refuses in-place writes
            h.mul_(op.p)
        return h
    if kind == "linear":
        return blk.mods[key](h)
    if kind == "linear2d":
        return blk.mods[key](h.reshape(-1, h.shape[-1])).view(h.shape)
    if kind == "matmul_param":
        return h @ blk.params[key]
    if kind == "einsum":
        return torch.einsum("btd,de->bte", h, blk.params[key])
    if kind == "bmm_attn":
        s = (h @ h.transpose(-1, -2)) / math.sqrt(h.shape[-1])
        return s.softmax(-1) @ h
    if kind == "baddbmm":
        s = torch.baddbmm(blk.params[key], h, h.transpose(1, 2), alpha=0.2)  # [B, T, T]
        return torch.bmm(s.tanh(), h)
    if kind == "sdpa":
        q4 = h.unsqueeze(1)  # [B, 1, T, D]
        return F.scaled_dot_product_attention(q4, q4.tanh(), q4, is_causal=op.flag).squeeze(1)
    # random ops
    if kind == "dropout":
        return F.dropout(h, op.p, training=blk.training)
    if kind == "dropout_module":
        return blk.mods[key](h)
    if kind == "rand_mask":
        return h * (torch.rand_like(h) > op.p)
    if kind == "randn_noise":
        return h + op.p * torch.randn_like(h)
    if kind == "bernoulli":
        return h * torch.bernoulli(torch.full_like(h, 1 - op.p))
    if kind == "sdpa_dropout":
        q4 = h.unsqueeze(1)
        return F.scaled_dot_product_attention(q4, q4, q4.sigmoid(), dropout_p=op.p).squeeze(1)
    if kind == "alpha_dropout":
        return F.alpha_dropout(h, op.p, training=blk.training)
    # multi-output ops
    d = h.shape[-1]
    if kind == "topk":
        v, _ = h.topk(max(1, min(d, int(op.p))), dim=-1)
        return h * v.mean(-1, keepdim=True).sigmoid()
    if kind == "topk_scatter":  # MoE-like: keep the top-k entries of each row, scatter them back
        v, idx = h.topk(max(1, min(d, int(op.p))), dim=-1)
        return torch.zeros_like(h).scatter(-1, idx, v.softmax(-1)) + h * 0.5
    if kind == "max_dim":
        m, idx = h.max(-1, keepdim=True)
        return h - m * 0.5 + h.gather(-1, idx) * 0.25
    if kind == "min_dim":
        m, idx = h.min(1, keepdim=True)
        return h + m + idx.to(h.dtype) * 0.01
    if kind == "sort":
        v, idx = h.sort(-1, descending=op.flag)
        return v * 0.5 + h.gather(-1, idx.flip(-1)) * 0.5
    if kind == "var_mean":
        v, m = torch.var_mean(h, -1, keepdim=True)
        return (h - m) * torch.rsqrt(v + 1e-5)
    if kind == "std_mean":
        s, m = torch.std_mean(h, 1, keepdim=True)
        return (h - m) / (s + 1)
    if kind == "kthvalue":
        v, _ = h.kthvalue(max(1, min(d, int(op.p))), -1, keepdim=True)
        return h - v
    if kind == "aminmax":
        lo, hi = torch.aminmax(h, dim=-1, keepdim=True)
        return (h - lo) / (hi - lo + 1)
    if kind == "median":
        m, _ = h.median(1, keepdim=True)
        return h - m
    # norms
    if kind in ("layer_norm", "rms_norm"):
        return blk.mods[key](h)
    if kind == "layer_norm_noaffine":
        return F.layer_norm(h, (d,))
    if kind == "rms_norm_f":
        return F.rms_norm(h, (d,), eps=1e-6)
    if kind == "group_norm":
        return blk.mods[key](h.transpose(1, 2)).transpose(1, 2)
    if kind == "batch_norm":
        return blk.mods[key](h.transpose(1, 2)).transpose(1, 2)
    # cat / stack
    if kind == "stack_sum":
        return torch.stack([h, p], 0).sum(0) * 0.5
    if kind == "cat_linear":
        return blk.mods[key](torch.cat([h, p], -1))
    if kind == "cat_t_slice":
        return torch.cat([h, p.tanh()], 1)[:, 1: 1 + h.shape[1]]
    if kind == "stack_weighted":
        return (torch.stack([h, p], -1) * blk.params[key]).sum(-1)
    # where / masked_fill
    if kind == "where":
        return torch.where(p > 0, h, q * 0.5)
    if kind == "masked_fill":
        return h.masked_fill(p.abs() > 1, 1.0)
    if kind == "where_scalar":
        return torch.where(h > p, h, 0.0)
    # gather / index_select
    idx = getattr(blk, f"idx{i}", None)
    if kind == "gather":
        return h.gather(-1, idx)
    if kind == "index_select_d":
        return torch.index_select(h, -1, idx)
    if kind == "index_select_t":
        return torch.index_select(h, 1, idx)
    if kind == "adv_index":
        return h[:, idx] * 0.7 + h
    if kind == "take_along":
        return torch.take_along_dim(h, idx, -1)
    if kind == "embedding":
        # A data-dependent lookup: rows chosen by argmax, an embedding table with repeated indices.
        rows = h.argmax(-1)  # [B, T]
        return h + F.embedding(rows, blk.params[key])
    # other
    if kind == "no_grad_scale":
        with torch.no_grad():
            s = h.abs().amax() + 1
        return h / s
    if kind == "detach_mix":
        return h + h.detach().sin() * h
    if kind == "residual":
        return h + p
    if kind == "custom_fn":
        return _SwishFn.apply(h)
    if kind == "scalar_ops":
        return (2.0 - h) * 0.5 + h / 3.0
    # exotic
    if kind == "out_no_grad":  # an out= op (no autograd) whose result a later op saves
        with torch.no_grad():
            s = torch.empty_like(h)
            torch.sigmoid(h, out=s)
        return h * s
    if kind == "index_put_acc":  # accumulate into repeated positions, in place on a fresh tensor
        t = _fresh(h, 0.5)
        rows = torch.tensor([0, 0, h.shape[1] - 1], device=h.device)
        t.index_put_((torch.zeros(3, dtype=torch.long), rows), p[0, :1].expand(3, -1), accumulate=True)
        return t
    if kind == "scatter_add":
        idx = torch.arange(h.shape[-1], device=h.device).flip(0).expand(h.shape) % max(1, h.shape[-1] // 2)
        return torch.zeros_like(h).scatter_add(-1, idx, h) + h * 0.1
    if kind == "diagonal_add_":
        t = _fresh(h, 1.0)
        t.diagonal(0, 1, 2).add_(p.diagonal(0, 1, 2).tanh())
        return t
    if kind == "checkpoint":  # torch.utils.checkpoint nested inside a tapesac block
        import torch.utils.checkpoint as ckpt

        return ckpt.checkpoint(lambda t: torch.sin(t) * torch.tanh(t), h, use_reentrant=False)
    if kind == "masked_scatter":
        mask = p > 0
        return h.masked_scatter(mask, h.flip(-1) * 0.5)
    if kind == "as_strided":
        b_, t_, d_ = h.shape
        hc = h.contiguous()
        return hc + hc.as_strided((b_, t_, d_), (t_ * d_, d_, 0)).tanh()  # broadcast the first column
    if kind == "external_kernel":
        factory = list(EXTERNAL_FACTORIES)[op.k % len(EXTERNAL_FACTORIES)]
        return _ExternalKernelFn.apply(h, factory, "ctypes" if op.flag else "numpy")
    if kind == "custom_op":
        which = CUSTOM_OPS[op.k % len(CUSTOM_OPS)]
        if which == "noise":  # the noise needs no gradient: mul saves it, "full" drops it
            return h * (0.5 + torch.ops.tapesac_rp.noise(h.detach()))
        if which == "noisy":
            return torch.ops.tapesac_rp.noisy(h)[0] + h * 0.25
        return torch.tanh(torch.ops.tapesac_rp.scale(h))
    if kind == "native_dropout_zero":  # keeps every element, yet draws on CPU in training
        return torch.native_dropout(h, 0.0, blk.training)[0] * 1.25
    if kind == "cond_branch":
        return torch.cond(h.sum() > 0, lambda u: torch.sin(u) * u, lambda u: torch.cos(u) * u, (h,))
    if kind == "sparse_mix":
        adj = _sparse_mix(h.shape[1]).to(h.dtype)
        return torch.stack([torch.sparse.mm(adj, h[i]) for i in range(h.shape[0])]).tanh() + h * 0.5
    if kind == "clone_contig_inplace":
        t = h.transpose(1, 2).clone(memory_format=torch.contiguous_format)
        t.mul_(1.5)
        return t.transpose(1, 2)
    raise KeyError(f"unknown op kind {kind!r}")


class ProgramModel(nn.Module):
    def __init__(self, program: Program):
        super().__init__()
        b, t, d = program.shape
        self.program = program
        self.stem = nn.Linear(d, d) if program.stem else None
        self.blocks = nn.ModuleList(RandomBlock(ops, program.shape, program.tuple_out) for ops in program.blocks)
        self.freed: dict[DataWrite, tuple[torch.Tensor, int]] = {}  # refills freed and not refilled yet

    def _call(self, blk: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if blk.ops and blk.ops[0].kind == "input_inplace" and h.requires_grad:
            # The node that made h may have saved it (tanh saves its result): the block writes a fresh alias-free
            # tensor whose node saves none, as a model that writes its input must give it.
            h = _fresh(h, 1.0)
        index = next(i for i, b in enumerate(self.blocks) if b is blk)
        handles = [_register_module_hook(blk, spec) for spec in self.program.module_hooks
                   if spec.inside and spec.block == index]  # Program._with_module_hooks, inside the step
        try:
            try:
                out = blk(h)
            except _BlockRetry:  # Program._with_retries: the partial call is dropped, the block runs again
                out = blk(h)
        finally:
            for handle in handles:
                handle.remove()
        if isinstance(out, tuple):
            return out[0] + 0.1 * out[1]
        return out

    def write_target(self, w: DataWrite) -> torch.Tensor:
        blk = self.blocks[w.block]
        first_linear = next(str(i) for i, op in enumerate(blk.ops) if op.kind == "linear")  # op 0, or 1 after an input write
        return blk.mods[first_linear].weight if w.target == "weight" else self.block_inputs[w.block]

    def data_write(self, w: DataWrite, phase: str = "both") -> None:
        """`phase` for refills: "free", "refill" (the values kept at the free; once) or "both"."""
        t = self.write_target(w)
        if w.refill:
            # Note [a storage reallocated unseen]: the refill may land at the freed block's address (glibc after some
            # allocation histories): the watcher sees the free itself (it holds CPU allocations while watching them).
            if phase in ("free", "both"):
                self.freed[w] = (t.detach().clone(), t.untyped_storage().nbytes())
                t.untyped_storage().resize_(0)
            if phase in ("refill", "both") and w in self.freed:
                values, n = self.freed.pop(w)
                t.untyped_storage().resize_(n)
                row = 0
                for c in values.chunk(w.refill):
                    t.data[row:row + c.shape[0]].copy_(c)
                    row += c.shape[0]
                if w.factor != 1.0:
                    t.data.mul_(w.factor)
        elif w.replace:
            t.data = t.data * w.factor  # a new storage: the tensor's data is replaced, no version moves
        else:
            t.data.mul_(w.factor)  # through .data: the version counter does not move

    def refill_pending(self) -> None:
        """Refills the "split" refills whose block's backward did not run (a forward without backward)."""
        for w in list(self.freed):
            self.data_write(w, "refill")

    def _after_block(self, i: int, h: torch.Tensor) -> None:
        for w in self.program.data_writes:
            if w.block != i:
                continue
            if w.where == "forward":
                self.data_write(w)
            elif w.where == "backward" and h.requires_grad:
                h.register_hook(lambda g, w=w: self.data_write(w))
            elif w.where == "split" and h.requires_grad:  # FSDP2's pattern: freed now, refilled before its backward
                self.data_write(w, "free")
                h.register_hook(lambda g, w=w: self.data_write(w, "refill"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:  # Program._with_retries: the block raises on its first call of each forward
            blk.armed = any(op.kind == "raise_once" for op in blk.ops)
        self.block_inputs: dict[int, torch.Tensor] = {}  # the targets of "input" writes (first call of each block)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.program.autocast):
            h = self.stem(x) if self.stem is not None else x
            for i, blk in enumerate(self.blocks):
                entry = [w for w in self.program.data_writes if w.where == "entry" and w.block == i]
                for w in entry:  # Program._with_entry_writes: no reference to h is kept
                    h.data.mul_(w.factor)
                if not entry:
                    self.block_inputs.setdefault(i, h)
                h = self._call(blk, h)
                self._after_block(i, h)
            if self.program.repeat_first:
                h = self._call(self.blocks[0], h)
        return h.float()


def _register_module_hook(block: nn.Module, spec: ModuleHook) -> Any:
    """Program._with_module_hooks: registers the user's hook `spec` on `block`; returns its handle."""
    f = spec.factor
    if spec.kind == "pre":
        return block.register_forward_pre_hook(lambda m, args: (args[0] * f, *args[1:]), prepend=spec.prepend)

    def scale_output(m: nn.Module, args: Any, out: Any) -> Any:
        return (out[0] * f, *out[1:]) if isinstance(out, tuple) else out * f

    return block.register_forward_hook(scale_output, prepend=spec.prepend)


def build_model(program: Program) -> ProgramModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(program.seed)
        model = ProgramModel(program)
    for spec in program.module_hooks:  # Program._with_module_hooks, registered before any step
        if not spec.inside:
            _register_module_hook(model.blocks[spec.block], spec)
    model.train()
    return model


def make_input(program: Program) -> torch.Tensor:
    g = torch.Generator().manual_seed(program.seed + 1)
    return torch.randn(*program.shape, generator=g).requires_grad_(program.input_grad)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean() + out.sum() * 0.01


# ----------------------------------------------------------------------------------------------------------------------
# Running and comparing
# ----------------------------------------------------------------------------------------------------------------------


class ProgramFailure(AssertionError):
    pass


class ProgramRejected(Exception):
    """The plain run itself is not a usable reference (non-finite loss or gradient)."""


@dataclass
class RunResult:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    input_grad: torch.Tensor | None
    buffers: dict[str, torch.Tensor]
    rng: torch.Tensor
    stats: Any = None
    warnings: list[str] = field(default_factory=list)
    # Every step's StepStats of a run of several steps (AutoLimit), in order.
    history: list[Any] = field(default_factory=list)
    # AutoLimit: every plan made (TapeSAC.plans), oldest first.
    plans: list[dict[str, Any]] = field(default_factory=list)


RUN_SEED = 12345


def _accumulate(tensors: list[torch.Tensor], grads: tuple) -> None:
    for t, g in zip(tensors, grads):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g


def run_step(model: "ProgramModel", program: Program, x: torch.Tensor) -> torch.Tensor:
    """The forward and backward of one step, shaped by `program.step`; the gradients end in `.grad`. Returns the
    loss (detached)."""
    out = model(x)
    between = [w for w in program.data_writes if w.where == "between"]
    params = [p for p in model.parameters() if p.requires_grad]
    wrt = params + ([x] if x.requires_grad else [])
    shape = program.step
    if shape == "backward":
        loss = loss_of(out)
        loss.backward()
    elif shape == "retain_twice":
        loss = loss_of(out)
        loss.backward(retain_graph=True)
        for w in between:
            model.data_write(w)
        loss.backward()
    elif shape == "two_losses":
        l1, l2 = out.square().mean(), out.sum() * 0.01
        l1.backward(retain_graph=True)
        for w in between:
            model.data_write(w)
        l2.backward()
        loss = l1 + l2
    elif shape == "autograd_grad":
        loss = loss_of(out)
        _accumulate(wrt, torch.autograd.grad(loss, wrt, allow_unused=True))
    elif shape == "grad_then_backward":
        l1, l2 = out.square().mean(), out.sum() * 0.01
        g1 = torch.autograd.grad(l1, wrt, retain_graph=True, allow_unused=True)
        for w in between:
            model.data_write(w)
        l2.backward()
        _accumulate(wrt, g1)
        loss = l1 + l2
    elif shape == "grads_batched":
        # autograd runs the backward under vmap over the two grad_outputs (Note [Replay outside the backward's
        # transforms], replay/src/replay_guard.h): replays, and their random ops, run inside it
        loss = loss_of(out)
        go = torch.tensor([1.0, -0.5], dtype=loss.dtype)
        grads = torch.autograd.grad(loss, wrt, grad_outputs=go, is_grads_batched=True, allow_unused=True)
        _accumulate(wrt, tuple(None if g is None else g[0] + g[1] for g in grads))
    elif shape == "double_backward":
        # the penalty's backward runs through the first backward's graph (create_graph): it unpacks the blocks'
        # saved tensors a second time and reads the tensors the first backward's ops saved, replays among them
        loss = loss_of(out)
        grads = torch.autograd.grad(loss, wrt, create_graph=True, allow_unused=True)
        penalty = sum((g * g).sum() for g in grads if g is not None)
        (loss + 0.1 * penalty).backward()
    else:
        raise KeyError(shape)
    model.refill_pending()
    return loss.detach()


def run_plain(model: nn.Module, program: Program) -> RunResult:
    x = make_input(program)
    torch.manual_seed(RUN_SEED)
    loss = run_step(model, program, x)
    return _run_result(model, loss, x)


def run_auto(model: nn.Module, program: Program, auto: AutoLimit, limit: int, initial: dict,
             grad_names: frozenset[str] = frozenset()) -> RunResult:
    """AutoLimit's run: the steps before the planned one restore `initial` after them; the planned step's result.
    `grad_names`: the parameters the plain run gives a gradient (zero-filled before each step after the measuring
    one when `auto.grads_kept`)."""
    import tapesac

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sac = tapesac.TapeSAC(model, blocks=model.blocks, memory_limit=limit, contract=program.contract,
                              schedule="planned" if auto.planned else "auto")
        try:
            if auto.forward_only_first:
                torch.manual_seed(RUN_SEED)
                with sac.step():
                    model(make_input(program))  # grad enabled, no backward
                model.refill_pending()
            for i in range(auto.steps):  # the measuring step, then the planned one(s)
                model.load_state_dict(initial)
                model.zero_grad(set_to_none=True)
                if auto.grads_kept and i > 0:  # 0 + g is g: the compared gradients stay the plain run's
                    for name, p in model.named_parameters():
                        if name in grad_names:
                            p.grad = torch.zeros_like(p)
                loss, x, stats = _compared_step(model, program, sac)
            history = list(sac.history)
            plans = list(sac.plans)
        finally:
            sac.close()
    result = _run_result(model, loss, x, stats, caught)
    result.history = history
    result.plans = plans
    return result


def run_tapesac(model: nn.Module, program: Program, policy: Any) -> RunResult:
    """The program's step under TapeSAC(policy, program's contract, schedule and backend); the warm-up steps
    (Program.warmup_steps) run first and are undone (parameters, buffers, gradients, input, RNG), so the step
    compared starts like the plain run's, with the schedules planned and the graphs captured."""
    import tapesac

    initial = copy.deepcopy(model.state_dict()) if program.warmup_steps() else None
    hook_was = tapesac._C.recorder_hook()
    tapesac._C.set_recorder_hook(program.hook)
    saved_was = tapesac._C.saved_hooks_in_cpp()
    tapesac._C.set_saved_hooks_in_cpp(program.saved_hooks == "cpp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sac = tapesac.TapeSAC(model, blocks=model.blocks, policy=policy, contract=program.contract,
                              schedule=program.schedule, backend=program.backend)
        try:
            for i in range(program.warmup_steps()):
                torch.manual_seed(RUN_SEED)
                x = make_input(program)
                if i == 0 and program.warmup == "strided":  # same values, [B, T, D] viewed from a [T, B, D] tensor
                    x = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(program.input_grad)
                with sac.step():
                    run_step(model, program, x)
                model.load_state_dict(initial)
                model.zero_grad(set_to_none=True)
            loss, x, stats = _compared_step(model, program, sac)
        finally:
            sac.close()
            tapesac._C.set_recorder_hook(hook_was)
            tapesac._C.set_saved_hooks_in_cpp(saved_was)
    return _run_result(model, loss, x, stats, caught)


def _compared_step(model: nn.Module, program: Program, sac: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One step of the program under `sac` from the run's seed: (loss, input, StepStats)."""
    x = make_input(program)
    torch.manual_seed(RUN_SEED)
    with sac.step():
        loss = run_step(model, program, x)
    return loss, x, sac.last_step


def _run_result(model: nn.Module, loss: torch.Tensor, x: torch.Tensor, stats: Any = None,
                caught: list | None = None) -> RunResult:
    """What a run leaves (read right after its step: the RNG state is the step's end state)."""
    return RunResult(loss, {n: p.grad for n, p in model.named_parameters()}, x.grad,
                     {n: b.clone() for n, b in model.named_buffers()}, torch.get_rng_state(), stats,
                     [str(w.message) for w in caught or []])


def _diff(name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> str | None:
    if got is None or want is None:
        if got is None and want is None:
            return None
        return f"{name}: tapesac {'None' if got is None else 'defined'}, plain {'None' if want is None else 'defined'}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: tapesac {tuple(got.shape)} {got.dtype}, plain {tuple(want.shape)} {want.dtype}"
    if torch.equal(got, want):
        return None
    d = (got.double() - want.double()).abs()
    return f"{name}: max |diff| {d.max().item():.3e}, {int((d != 0).sum())} of {d.numel()} elements differ"


def compare(got: RunResult, want: RunResult) -> list[str]:
    out = [_diff("loss", got.loss, want.loss), _diff("input grad", got.input_grad, want.input_grad)]
    out += [_diff(f"grad of {n}", got.grads[n], want.grads[n]) for n in want.grads]
    out += [_diff(f"buffer {n}", got.buffers[n], want.buffers[n]) for n in want.buffers]
    if not torch.equal(got.rng, want.rng):
        out.append("CPU RNG state after the step differs (replay advanced or changed the generator)")
    return [m for m in out if m]


def random_op_set(model: nn.Module, program: Program) -> frozenset[str]:
    """A random subset of the ops the program's forward records (so that the set keeps something)."""
    import tapesac

    state = copy.deepcopy(model.state_dict())  # record_ops runs the forward: BatchNorm stats move
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RUN_SEED)
        try:
            names = sorted(set(tapesac.record_ops(model, make_input(program))))
        except tapesac.CaptureError:  # a `.data = ...` inside a block (data_write_saved): recording stops there
            names = ["aten::addmm", "aten::linear", "aten::tanh"]  # every block starts with linear, tanh
    model.refill_pending()
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    rng = random.Random(program.op_set_seed)
    return frozenset(n for n in names if rng.random() < 0.35)


@dataclass(frozen=True)
class AutoLimit:
    """Policy "auto" under a memory_limit `frac` of the way from the "full" to the "none" step peak (measured by
    those policies' runs of the same program), run for `steps` steps from the same initial state — the measuring step
    (after a forward-only step when `forward_only_first`), then the planned step, and with 3 the step after it (under
    a plan made again if the first plan ran over its limit) — the last of which is compared with the plain run and
    must peak within the limit (issue 18 item 5: auto in the program's step shape); every step over the limit must be
    flagged. With `grads_kept` the steps after the measuring one start with zero gradients already allocated (as
    under gradient accumulation, or zero_grad(set_to_none=False)): their baseline grew after the first plan was made
    (Note [Baseline grown before the step]); the limit is raised by those gradients' bytes. `planned`: replay
    schedules planned with the masks (schedule="planned"; else auto's one segment per call). Half the 3-step runs run
    a 4th step: a plan topped up after step 2 (Note [Top-up]) runs in step 3, and may be topped up again."""

    frac: float
    forward_only_first: bool = False
    steps: int = 2
    grads_kept: bool = False
    planned: bool = False


def auto_limit_for(program: Program) -> AutoLimit:
    rng = random.Random(f"issue18-auto-{program.seed}")
    frac, forward_only_first = rng.choice([0.0, 0.3, 0.7, 1.0]), rng.random() < 0.2
    # Its own stream, so that the programs' limits stay as they were: a third of them run a third step (re-plans).
    steps = 3 if random.Random(f"replan-steps-{program.seed}").random() < 1 / 3 else 2
    grads_kept = random.Random(f"grads-kept-{program.seed}").random() < 1 / 4
    if steps == 3 and random.Random(f"top-up-steps-{program.seed}").random() < 1 / 2:
        steps = 4
    # Not at the no-checkpoint peak: there auto keeps everything with one-segment schedules only (README, *Replay
    # schedules*: planned schedules there stay opt-in).
    planned = frac < 1.0 and random.Random(f"auto-planned-{program.seed}").random() < 1 / 4
    return AutoLimit(frac=frac, forward_only_first=forward_only_first, steps=steps, grads_kept=grads_kept,
                     planned=planned)


def policies_for(model: nn.Module, program: Program) -> list[tuple[str, Any]]:
    return [("full", "full"), ("none", "none"), ("op_set", random_op_set(model, program)),
            ("auto", auto_limit_for(program))]


@dataclass
class ProgramOutcome:
    program: Program
    rejected: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # Policies whose step raised ReplayContractError on a program with a .data write ("rejected, never silent").
    contract_rejections: dict[str, str] = field(default_factory=dict)
    # AutoLimit's memory outcomes (counted by tally(), not failures: the README's "flagged" and "raised" outcomes;
    # a refused limit's message must name it): refused with MemoryLimitError below / at the "none" peak, and by how
    # many bytes the planned step exceeded the limit (flagged over_limit).
    auto_refused: str = ""
    auto_refused_at_none_peak: str = ""
    auto_over_limit_bytes: int = 0
    # At a limit at the "none" peak (frac 1) the planned step dropped tensors: README's "a limit at or above the
    # no-checkpoint peak keeps everything" missed (counted).
    auto_dropped_at_none_peak: bool = False
    # A plan topped up (Note [Top-up]) ran in a later step of the run.
    auto_topped_up: bool = False


def check_program(seed: int, policies: list[str] | None = None) -> ProgramOutcome:
    """Runs program `seed` plain and under each policy; raises ProgramFailure with the seed and program on mismatch."""
    return check(Program.generate(seed), policies)


def check(program: Program, policies: list[str] | None = None, extra: dict[str, Any] | None = None) -> ProgramOutcome:
    """check_program for a given Program; `extra` adds labelled policies (e.g. a fixed op set)."""
    seed = program.seed
    base = build_model(program)
    # One model for every run (cheaper than deep copies): the initial state is restored before each run.
    initial = copy.deepcopy(base.state_dict())
    try:
        want = run_plain(base, program)
    except Exception as e:  # the generator must only emit valid programs: report it like a failure
        raise ProgramFailure(f"seed {seed}: the plain run (no tapesac) raised {type(e).__name__}: {e}\n{program}") from e
    finite = math.isfinite(want.loss.item()) and all(
        g is None or bool(torch.isfinite(g).all()) for g in [want.input_grad, *want.grads.values()])
    if not finite:
        return ProgramOutcome(program, rejected=True)
    outcome = ProgramOutcome(program)
    base.load_state_dict(initial)
    base.zero_grad(set_to_none=True)
    for label, policy in policies_for(base, program) + list((extra or {}).items()):
        if policies is not None and label not in policies:
            continue
        model = base
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        shown = policy if isinstance(policy, AutoLimit) else sorted(policy)
        where = f"seed {seed}, policy {label}{'' if isinstance(policy, str) else ' ' + repr(shown)}"
        limit = 0
        try:
            if isinstance(policy, AutoLimit):
                if "full" not in outcome.stats or "none" not in outcome.stats:
                    continue  # the limit comes from their peaks (a .data write may have rejected them)
                full, none = outcome.stats["full"].memory.peak_bytes, outcome.stats["none"].memory.peak_bytes
                limit = max(full, int(full + policy.frac * (none - full)))
                grad_names = frozenset(n for n, g in want.grads.items() if g is not None)
                if policy.grads_kept:
                    grads = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in grad_names)
                    limit += grads
                    where += f" (gradients kept: +{grads} bytes)"
                where += f" (memory_limit {limit}: {policy.frac} of the way from full {full} to none {none})"
                got = run_auto(model, program, policy, limit, initial, grad_names)
            else:
                got = run_tapesac(model, program, policy)
        except Exception as e:
            import tapesac

            if program.data_writes and isinstance(e, tapesac.ReplayContractError):
                outcome.contract_rejections[label] = str(e)  # rejected, not silent: allowed for .data writes
                continue
            # auto may refuse a limit, naming it and a larger figure (counted; README: never silently over).
            if (isinstance(policy, AutoLimit) and isinstance(e, tapesac.MemoryLimitError)
                    and f"({limit} bytes)" in str(e) and "at least " in str(e)):
                if policy.frac < 1.0:
                    outcome.auto_refused = str(e)
                else:
                    outcome.auto_refused_at_none_peak = str(e)
                continue
            raise ProgramFailure(f"{where}: the tapesac step raised {type(e).__name__}: {e}\n{program}\n"
                                 f"reproduce: cd tests/python && python3 -c 'import random_program as R; "
                                 f"R.check_program({seed})'") from e
        diffs = compare(got, want)
        st = got.stats
        if not diffs:
            calls = len(program.blocks) + program.repeat_first + program.ops().count("raise_once")  # + aborted calls
            if st is None or st.ops_recorded <= 0 or st.saved_tensors <= 0 or st.block_calls != calls:
                diffs.append(f"tapesac recorded nothing or the wrong number of blocks: {st}")
            elif label == "none" and (st.dropped_tensors or st.ops_replayed):
                diffs.append(f"policy 'none' dropped or replayed: {st}")
            elif label == "full" and (st.dropped_tensors == 0 or st.ops_replayed == 0):
                diffs.append(f"policy 'full' dropped or replayed nothing (every block saves tanh's output): {st}")
            elif limit and st.memory.peak_bytes > limit:
                if not st.over_limit:
                    diffs.append(f"policy 'auto': the planned step peaked at {st.memory.peak_bytes} bytes, over the "
                                 f"memory_limit {limit}, and is not flagged over_limit")
                outcome.auto_over_limit_bytes = st.memory.peak_bytes - limit
            if isinstance(policy, AutoLimit):  # every step over the limit is flagged, not only the compared one
                silent = [i for i, h in enumerate(got.history) if h.memory.peak_bytes > limit and not h.over_limit]
                if silent:
                    diffs.append(f"policy 'auto': steps {silent} of {len(got.history)} peaked over the memory_limit "
                                 f"{limit} and are not flagged over_limit: {[h.memory.peak_bytes for h in got.history]}")
            if isinstance(policy, AutoLimit):
                outcome.auto_topped_up = any(p["model"] == "measured" and p["after_step"] < len(got.history)
                                             for p in got.plans)
            if isinstance(policy, AutoLimit) and policy.frac >= 1.0 and st is not None and st.dropped_tensors > 0:
                outcome.auto_dropped_at_none_peak = True
        if diffs:
            raise ProgramFailure(f"{where}: tapesac differs from the plain run:\n  " + "\n  ".join(diffs[:8]) +
                                 f"\n{program}\nreproduce: cd tests/python && python3 -c 'import random_program as R; "
                                 f"R.check_program({seed})'")
        outcome.stats[label] = st
        outcome.warnings += got.warnings
    return outcome


def tally(seeds: range) -> dict[str, Any]:
    """Runs check_program over `seeds` and counts, per family (Program.families, and per schedule and backend:
    "schedule:lazy", "backend:emulated_graph"), the programs, the failures (a
    gradient differs, or the step raised) and the contract rejections. For reports: `python random_program.py 0 500`."""
    per: dict[str, dict[str, int]] = {}
    totals = {"auto_within_limit": 0, "auto_over_limit": 0, "auto_refused_limit": 0, "auto_refused_at_none_peak": 0,
              "auto_dropped_at_none_peak": 0, "auto_topped_up": 0, "auto_topped_up_over_limit": 0}
    failures: list[tuple[int, list[str], str]] = []
    # The seeds of the outcomes the README's "a limit at or above the no-checkpoint peak keeps everything" misses.
    at_none: dict[str, list[int]] = {"refused_at_none_peak": [], "dropped_at_none_peak": []}
    for seed in seeds:
        program = Program.generate(seed)
        fams = program.families() + [f"schedule:{program.schedule}", f"backend:{program.backend}",
                                     f"auto:{'planned' if auto_limit_for(program).planned else 'one_segment'}"]
        for f in fams:
            per.setdefault(f, {"programs": 0, "failed": 0, "rejected_by_contract": 0, "non_finite": 0,
                               "auto_refused_limit": 0, "auto_refused_at_none_peak": 0,
                               "auto_over_limit": 0})["programs"] += 1
        try:
            outcome = check_program(seed)
        except ProgramFailure as e:
            failures.append((seed, fams, str(e)[:4000]))  # the diffs and the program: a flaky one may not come back
            for f in fams:
                per[f]["failed"] += 1
            continue
        for f in fams:
            per[f]["non_finite"] += outcome.rejected
            per[f]["rejected_by_contract"] += bool(outcome.contract_rejections)
            per[f]["auto_refused_limit"] += bool(outcome.auto_refused)
            per[f]["auto_refused_at_none_peak"] += bool(outcome.auto_refused_at_none_peak)
            per[f]["auto_over_limit"] += outcome.auto_over_limit_bytes > 0
        totals["auto_dropped_at_none_peak"] += outcome.auto_dropped_at_none_peak
        totals["auto_topped_up"] += outcome.auto_topped_up
        totals["auto_topped_up_over_limit"] += outcome.auto_topped_up and outcome.auto_over_limit_bytes > 0
        if outcome.auto_dropped_at_none_peak:
            at_none["dropped_at_none_peak"].append(seed)
        if outcome.auto_refused_at_none_peak:
            at_none["refused_at_none_peak"].append(seed)
        if outcome.auto_refused or outcome.auto_refused_at_none_peak:
            totals["auto_refused_limit" if outcome.auto_refused else "auto_refused_at_none_peak"] += 1
        elif outcome.auto_over_limit_bytes > 0:
            totals["auto_over_limit"] += 1
        elif "auto" in outcome.stats:
            totals["auto_within_limit"] += 1
    return {"families": per, "failures": failures, "programs": len(seeds), "auto": totals, "auto_at_none_seeds": at_none}


if __name__ == "__main__":
    import json
    import sys

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    first, last = int(sys.argv[1]), int(sys.argv[2])
    result = tally(range(first, last))
    print(json.dumps(result["families"], indent=1, sort_keys=True))
    print(f"{len(result['failures'])} of {result['programs']} programs failed")
    print("policy auto's memory outcomes (programs):", json.dumps(result["auto"], sort_keys=True))
    print("at the no-checkpoint peak (seeds):", json.dumps(result["auto_at_none_seeds"], sort_keys=True))
    for seed, fams, msg in result["failures"]:
        print(f"  seed {seed} {fams}: {msg}")
