"""The C++ recorder sees the same op sequence as a Python TorchDispatchMode reference.

`tapesac.record_ops(fn, *args, **kwargs)` returns the ops it recorded "at autograd level" (composite-implicit ops
decomposed, ops nested inside kernels not included). A TorchDispatchMode sees exactly those ops, except where the
mode itself changes what runs. Two such artifacts, handled here:
1. While a Python mode is active, autograd saving an op's *output* goes through `shallow_copy_and_detach`, which
   dispatches an extra `aten::detach` to the mode. Without a mode no such op runs, so the reference drops a
   `detach` dispatched from the very same Python call site (frame and bytecode offset) as the op just before it;
   a user's `.detach()` is always its own call site and is kept.
2. `at::isTensorSubclassLike` is true for every tensor while a Python dispatch mode is active
   (ATen/TensorSubclassLikeUtils.h), so composite ATen code takes its subclass-safe branch under the reference:
   `reshape` of a non-contiguous view-able tensor calls `view` instead of `_reshape_alias`, and the math SDPA
   kernel adds the mask out of place (`add.Tensor`) instead of in place (`add_.Tensor`). The comparison maps
   `_reshape_alias` to `view` always, and `add_.Tensor` to `add.Tensor` only for blocks that run the math SDPA
   path (SDPA with dropout on CPU).
Both runs use the same seed and the same grad mode (inputs require grad), so they execute the same ops. Each test runs
once per recorder hook (the `recorder_hook` fixture: the dispatch hook and at::RecordFunction, Note [Dispatch hook]).
"""

from __future__ import annotations

import difflib
import sys
from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import models as M


def op_name(func) -> str:
    s = func._schema
    return s.name + ("." + s.overload_name if s.overload_name else "")


class ReferenceOpLog(TorchDispatchMode):
    """Logs every op that reaches the Python dispatch key, minus the saved-output detach artifact."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.artifacts = 0
        self._last_site = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        frame = sys._getframe(1)
        site = (id(frame), frame.f_lasti)
        if name == "aten::detach" and site == self._last_site:
            self.artifacts += 1
        else:
            self.ops.append(name)
        self._last_site = site
        return func(*args, **(kwargs or {}))


def reference_ops(fn: Callable, *args, **kwargs) -> list[str]:
    with ReferenceOpLog() as log:
        fn(*args, **kwargs)
    return log.ops


ALWAYS_EQUIVALENT = {"aten::_reshape_alias": "aten::view"}
MATH_SDPA_EQUIVALENT = {**ALWAYS_EQUIVALENT, "aten::add_.Tensor": "aten::add.Tensor"}


def normalize(ops: list[str], equivalent: dict[str, str]) -> list[str]:
    return [equivalent.get(o, o) for o in ops]


def assert_same_ops(got: list[str], want: list[str], what: str,
                    equivalent: dict[str, str] = ALWAYS_EQUIVALENT) -> None:
    got, want = normalize(got, equivalent), normalize(want, equivalent)
    if got == want:
        return
    diff = "\n".join(difflib.unified_diff(want, got, "TorchDispatchMode reference", "tapesac.record_ops",
                                          lineterm="", n=2))
    print(f"--- op sequence mismatch for {what} ---\n{diff}")
    raise AssertionError(f"{what}: record_ops returned {len(got)} ops, the reference saw {len(want)}; diff:\n{diff}")


def _check(fn: Callable, make_args: Callable[[], tuple[tuple, dict]], what: str, min_ops: int = 3,
           equivalent: dict[str, str] = ALWAYS_EQUIVALENT) -> list[str]:
    import tapesac

    torch.manual_seed(0)
    args, kwargs = make_args()
    torch.manual_seed(1)
    want = reference_ops(fn, *args, **kwargs)
    torch.manual_seed(0)
    args, kwargs = make_args()
    torch.manual_seed(1)
    got = tapesac.record_ops(fn, *args, **kwargs)
    assert isinstance(got, list) and all(isinstance(o, str) for o in got), f"record_ops returned {type(got)}"
    assert len(want) >= min_ops, f"the reference saw only {want}: the test model is wrong"
    assert_same_ops(got, want, what, equivalent)
    return got


def _x(d: int = M.D):
    return lambda: ((torch.randn(M.B, M.T, d, requires_grad=True),), {})


TOY_BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "mlp": M.MLPBlock,
    "attention": M.AttentionBlock,
    "attention_dropout": lambda: M.AttentionBlock(dropout=0.2),
    "dropout": M.DropoutBlock,
    "inplace": M.InplaceBlock,
    "views": M.ViewBlock,
    "multi_output": M.MultiOutputBlock,
    "no_grad_region": M.NoGradBlock,
    "wasteful": M.WastefulBlock,
}


@pytest.mark.parametrize("name", list(TOY_BLOCKS))
def test_record_ops_matches_dispatch_mode_on_toy_blocks(name: str, recorder_hook: str) -> None:
    torch.manual_seed(0)
    block = TOY_BLOCKS[name]().train()
    got = _check(block, _x(), name,
                 equivalent=MATH_SDPA_EQUIVALENT if name == "attention_dropout" else ALWAYS_EQUIVALENT)
    if name == "mlp":
        # F.linear on a 3-D input decomposes below autograd level into these ops; `aten::linear` itself is
        # CompositeImplicitAutograd and must not appear.
        assert "aten::linear" not in got and "aten::gelu" in got, got
    if name == "no_grad_region":
        assert "aten::amax" in got and "aten::gt.Scalar" in got, f"ops under torch.no_grad() are missing: {got}"
    if name == "inplace":
        assert {"aten::relu_", "aten::mul_.Tensor", "aten::add_.Tensor", "aten::clone"} <= set(got), got
    if name == "dropout":
        assert "aten::rand_like" in got, f"a random op is missing from the tape: {got}"


def test_record_ops_kwargs_and_non_tensor_args(recorder_hook: str) -> None:
    torch.manual_seed(0)
    block = M.KwargsBlock()

    def make():
        x = torch.randn(M.B, M.T, M.D, requires_grad=True)
        mask = torch.randn(M.T, M.D, requires_grad=True)
        return (x,), dict(scale=0.5, mask=mask, flag=False, names=("a", "b"))

    got = _check(block, make, "KwargsBlock")
    assert "aten::tanh" in got and "aten::gelu" not in got, f"flag=False must select tanh: {got}"


def test_record_ops_under_no_grad_and_on_a_plain_function(recorder_hook: str) -> None:
    """Same grad mode for both: under no_grad the reference sees no detach artifacts and the recorder sees
    the same ops; record_ops also takes a plain function."""

    def fn(a, b, *, k):
        return torch.topk(torch.tanh(a @ b), k=k, dim=-1)

    def make():
        return (torch.randn(8, 8), torch.randn(8, 8)), dict(k=3)

    with torch.no_grad():
        got = _check(fn, make, "plain function under no_grad", min_ops=3)
    assert got == ["aten::mm", "aten::tanh", "aten::topk"], got


def test_record_ops_sees_factory_functions_called_from_python(recorder_hook: str) -> None:
    """torch.ones / zeros_like / rand_like called from Python run their ATen op at autograd level (the Python
    binding wraps it in AutoDispatchBelowADInplaceOrView, see torch/csrc/autograd/generated/variable_factories.h),
    and their outputs feed saved tensors: they belong on the tape, and the ops inside their kernels do not."""

    def fn(x):
        return torch.rand_like(x) * x, torch.zeros_like(x) + x, torch.ones(3, 4) * x

    got = _check(fn, lambda: ((torch.randn(3, 4, requires_grad=True),), {}), "factory functions")
    assert got == ["aten::rand_like", "aten::mul.Tensor", "aten::zeros_like", "aten::add.Tensor", "aten::ones",
                   "aten::mul.Tensor"], got


def test_record_ops_has_no_side_effects_on_hooks() -> None:
    import tapesac

    block = M.MLPBlock()
    x = torch.randn(4, M.D, requires_grad=True)
    tapesac.record_ops(block, x)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not block._forward_hooks and not block._forward_pre_hooks
    y = x.exp()
    assert isinstance(y.grad_fn._saved_result, torch.Tensor)


def _hf_layer_case(family: str, padded: bool, experts: str | None = None):
    torch.manual_seed(0)
    overrides = {} if experts is None else dict(experts_implementation=experts)
    model = M.HF_MODELS[family](2, **overrides).train()
    layer = model.model.layers[1]

    def make():
        hidden = torch.randn(M.B, M.T, model.config.hidden_size, requires_grad=True)
        mask2d = None
        if padded:
            mask2d = torch.ones(M.B, M.T, dtype=torch.long)
            mask2d[0, :3] = 0  # left padding in the first sequence: a 4-D mask is passed
        return (hidden,), M.hf_layer_kwargs(model, hidden.detach(), mask2d)

    return layer, make


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_record_ops_matches_dispatch_mode_on_hf_decoder_layer(family: str, padded: bool, recorder_hook: str) -> None:
    layer, make = _hf_layer_case(family, padded)
    (hidden,), kwargs = make()
    assert (kwargs["attention_mask"] is not None) == padded, "create_causal_mask changed behaviour; fix the test"
    got = _check(layer, make, f"{family} decoder layer ({'padded' if padded else 'no mask'})", min_ops=20)
    assert "aten::linear" not in got
    assert any("scaled_dot_product" in o or o == "aten::bmm" for o in got), got


def test_record_ops_matches_dispatch_mode_on_moe_layer_with_eager_experts(recorder_hook: str) -> None:
    """Data-dependent ops (nonzero, where, index_add_) and a no_grad routing region."""
    layer, make = _hf_layer_case("qwen3_moe", False, experts="eager")
    got = _check(layer, make, "qwen3_moe decoder layer (eager experts)", min_ops=20)
    assert "aten::index_add_" in got and "aten::nonzero" in got, got
