"""Shared configuration, fixtures and the reference check for the tapesac pytest suite.

The reference check is the heart of the suite: a deep copy of the model runs without tapesac, the original runs
inside `with sac.step()`, and loss, every named parameter gradient and every input gradient must be bitwise equal
(CPU, fp32: no tolerance anywhere). It also asserts that tapesac really did something (ops recorded; under
"full", tensors dropped and ops replayed), so that it cannot pass with tapesac doing nothing.
"""

from __future__ import annotations

import os
import tempfile

# Before anything imports transformers: no network, ever. CUBLAS_WORKSPACE_CONFIG makes cuBLAS deterministic
# under torch.use_deterministic_algorithms(True) on the GPU machine; it must be set before CUDA initialises.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# hypothesis keeps its scratch files out of the source tree.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "tapesac-hypothesis"))

import copy
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import models` from any working directory


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; deselected when torch.cuda.is_available() is False")
    config.addinivalue_line("markers", "profiler: runs torch.profiler; ordered after every other test of the session "
                                       "(profiler_last)")


def profiler_last(items: list[Any]) -> None:
    """Moves the items marked `profiler` to the end, keeping both groups' order. Once a process ran torch.profiler,
    kineto stays subscribed to CUPTI and tapesac can never claim CUPTI again there (issue 17 item 5): a CUPTI test
    after a profiler test would fail for that reason alone."""
    items[:] = ([i for i in items if i.get_closest_marker("profiler") is None]
                + [i for i in items if i.get_closest_marker("profiler") is not None])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    profiler_last(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu case: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic():
    """Deterministic kernels and a fixed seed for every test; restores the global flags afterwards."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture
def tapesac():
    """The tapesac package (imported lazily, so collection works before the extension is built)."""
    import tapesac as mod

    return mod


@pytest.fixture(params=["dispatch_key", "record_function"])
def recorder_hook(request):
    """Runs the test once per way the recorder sees operator calls (Note [Dispatch hook]); restores the default."""
    import tapesac as mod

    was = mod._C.recorder_hook()
    mod._C.set_recorder_hook(request.param)
    yield request.param
    mod._C.set_recorder_hook(was)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-tensor tests (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    with two OpenMP threads on a loaded 2-core machine every kernel waits for a spinning peer, which makes such a
    module 10-20x slower. Results do not change: every comparison runs both sides with the same thread count, and
    the Python threads of the threading tests are unaffected (intra-op parallelism is per op)."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


def device_param(*marks_for_gpu):
    """`@pytest.mark.parametrize("device", device_param())`: cpu always, cuda marked gpu."""
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, *marks_for_gpu])]


# ----------------------------------------------------------------------------------------------------------------------
# Reference check
# ----------------------------------------------------------------------------------------------------------------------


def default_loss(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Loss for plain modules: inputs is a tuple of positional args, or a dict of keyword args."""
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.square().mean()


def default_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _tensors(obj: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def assert_same_tensor(name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if want is None or got is None:
        assert got is None and want is None, (
            f"{name}: tapesac gradient is {'None' if got is None else 'defined'}, "
            f"reference gradient is {'None' if want is None else 'defined'}")
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{name}: tapesac {tuple(got.shape)} {got.dtype} vs reference {tuple(want.shape)} {want.dtype}")
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs()
        raise AssertionError(
            f"{name}: not bitwise equal to the reference: max |diff| = {diff.max().item():.3e}, "
            f"{int((diff != 0).sum())} of {diff.numel()} elements differ")


def assert_same_grads(model: nn.Module, ref: nn.Module, what: str = "") -> int:
    """Every named parameter's .grad bitwise equal (or both None). Returns the number of defined gradients."""
    got = dict(model.named_parameters())
    want = dict(ref.named_parameters())
    assert list(got) == list(want), f"parameter names differ: {sorted(set(got) ^ set(want))}"
    defined = 0
    for name, p in got.items():
        assert_same_tensor(f"{what}grad of {name}", p.grad, want[name].grad)
        defined += p.grad is not None
    return defined


def assert_same_params(model: nn.Module, ref: nn.Module, what: str = "") -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_same_tensor(f"{what}parameter {name}", p.detach(), q.detach())


def assert_same_buffers(model: nn.Module, ref: nn.Module, what: str = "") -> None:
    """Buffers (BatchNorm running stats, num_batches_tracked, ...) are written exactly as often as in the reference:
    replay must never re-apply a mutation of external state."""
    got, want = dict(model.named_buffers()), dict(ref.named_buffers())
    assert list(got) == list(want), f"buffer names differ: {sorted(set(got) ^ set(want))}"
    for name, b in got.items():
        assert_same_tensor(f"{what}buffer {name}", b, want[name])


def assert_rng_equal(device: str, got: dict, want: dict) -> None:
    for key in want:
        assert torch.equal(got[key], want[key]), (
            f"{key} RNG state after the tapesac step differs from the reference: replay advanced or changed the "
            f"generator (it must restore the recorded state and leave the live one untouched)")


def rng_state(device: str) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


@dataclass
class RefResult:
    sac: Any
    model: nn.Module
    ref: nn.Module
    loss: torch.Tensor
    ref_loss: torch.Tensor
    stats: Any  # sac.last_step of the last step
    all_stats: list


def check_stats(stats: Any, policy: Any, *, expect_drop: bool | None = None, expect_replay: bool | None = None,
                block_calls: int | None = None) -> None:
    """The step really did something: ops recorded; "full" drops and replays; "none" drops nothing."""
    assert stats.ops_recorded > 0, f"the step recorded no ops (ops_recorded={stats.ops_recorded}): tapesac saw nothing"
    assert stats.saved_tensors > 0, f"no saved tensor went through tapesac's pack hook: {stats}"
    if block_calls is not None:
        assert stats.block_calls == block_calls, f"block_calls={stats.block_calls}, expected {block_calls}"
    assert stats.dropped_tensors <= stats.saved_tensors, stats
    if policy == "none":
        assert stats.dropped_tensors == 0 and stats.dropped_bytes == 0, f"policy 'none' dropped tensors: {stats}"
        assert stats.ops_replayed == 0 and stats.replays == 0, f"policy 'none' replayed ops: {stats}"
        return
    if expect_drop is None:
        expect_drop = True
    if expect_replay is None:
        expect_replay = expect_drop
    if expect_drop:
        assert stats.dropped_tensors > 0 and stats.dropped_bytes > 0, (
            f"policy {policy!r} dropped nothing (dropped_tensors={stats.dropped_tensors}, "
            f"dropped_bytes={stats.dropped_bytes}): the test would pass without tapesac")
    if expect_replay:
        assert stats.ops_replayed > 0 and stats.replays > 0, (
            f"policy {policy!r} replayed nothing (ops_replayed={stats.ops_replayed}, replays={stats.replays})")
        assert sum(stats.ops_replayed_by_name.values()) == stats.ops_replayed, (
            f"ops_replayed_by_name sums to {sum(stats.ops_replayed_by_name.values())}, "
            f"ops_replayed is {stats.ops_replayed}")


def peak_of_policy(make_model: Callable[[], nn.Module], blocks: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                   make_inputs: Callable[[], Any], policy: str, steps: int = 2) -> int:
    """The largest step peak of `steps` steps of `policy` on a fresh model (seeded as reference_check seeds it;
    `blocks` as there: a spec or a function model -> spec), gradients set to None between steps."""
    import tapesac

    torch.manual_seed(0)
    model = make_model().train()
    sac = tapesac.TapeSAC(model, blocks=blocks(model) if isinstance(blocks, types.FunctionType) else blocks,
                          policy=policy)
    try:
        for step in range(steps):
            torch.manual_seed(1000 + step)
            inputs = make_inputs()
            torch.manual_seed(2000 + step)
            with sac.step():
                loss_fn(model, inputs).backward()
            model.zero_grad(set_to_none=True)
        return max(h.memory.peak_bytes for h in sac.history)
    finally:
        sac.close()


def limit_between_full_and_none(make_model: Callable[[], nn.Module], blocks: Any,
                                loss_fn: Callable[[nn.Module, Any], torch.Tensor], make_inputs: Callable[[], Any],
                                frac: float) -> int:
    """A memory_limit `frac` of the way from `full`'s step peak to `none`'s (peak_of_policy); asserts there is room
    between them to plan in."""
    full = peak_of_policy(make_model, blocks, loss_fn, make_inputs, "full")
    none = peak_of_policy(make_model, blocks, loss_fn, make_inputs, "none")
    assert none > full * 1.05, f"none peaks at {none}, full at {full}: no room to plan in (pick a larger input)"
    return int(full + frac * (none - full))


def reference_check(make_model: Callable[[], nn.Module], make_inputs: Callable[[], Any], policy: Any, blocks: Any,
                    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = default_loss, *,
                    backward_fn: Callable[[torch.Tensor], None] = default_backward,
                    steps: int = 1, optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                    device: str = "cpu", train: bool = True, expect_drop: bool | None = None,
                    expect_replay: bool | None = None, block_calls: int | None = None,
                    sac_kwargs: dict | None = None, seed: int = 0) -> RefResult:
    """Run `steps` training steps on a deep copy without tapesac and on the original inside `with sac.step()`.

    make_model() builds the model (seeded here); make_inputs() builds one step's inputs (a tuple of positional
    arguments, a dict of keyword arguments, or whatever loss_fn takes), seeded identically for both runs, so each
    run gets its own, equal, input tensors (input gradients are compared too). `blocks` is a blocks spec, or a
    function model -> blocks spec (e.g. lambda m: list(m.blocks)).
    After each step: loss, every parameter gradient and every input gradient are bitwise equal, the CPU (and CUDA)
    RNG state equals the reference's, and the step's stats show real work (see check_stats).
    With `optimizer` (params -> Optimizer), both copies take an optimizer step and zero their gradients after the
    comparison, and parameters are compared after each optimizer step.
    """
    import tapesac

    torch.manual_seed(seed)
    model = make_model().to(device)
    model.train(train)
    ref = copy.deepcopy(model)
    blocks_spec = blocks(model) if isinstance(blocks, types.FunctionType) else blocks
    sac = tapesac.TapeSAC(model, blocks=blocks_spec, policy=policy, **(sac_kwargs or {}))
    opt = optimizer(model.parameters()) if optimizer else None
    ref_opt = optimizer(ref.parameters()) if optimizer else None
    all_stats = []
    try:
        for step in range(steps):
            torch.manual_seed(1000 + step)
            ref_inputs = make_inputs()
            torch.manual_seed(1000 + step)
            inputs = make_inputs()

            torch.manual_seed(2000 + step)
            ref_loss = loss_fn(ref, ref_inputs)
            backward_fn(ref_loss)
            ref_rng = rng_state(device)

            torch.manual_seed(2000 + step)
            with sac.step():
                loss = loss_fn(model, inputs)
                backward_fn(loss)
            rng = rng_state(device)

            what = f"step {step + 1}: "
            assert_same_tensor(f"{what}loss", loss.detach(), ref_loss.detach())
            defined = assert_same_grads(model, ref, what)
            assert_same_buffers(model, ref, what)
            assert defined > 0, "no parameter received a gradient: the test checks nothing"
            for i, (t, r) in enumerate(zip(_tensors(inputs), _tensors(ref_inputs))):
                if r.requires_grad:
                    assert_same_tensor(f"{what}grad of input tensor #{i}", t.grad, r.grad)
            assert_rng_equal(device, rng, ref_rng)

            stats = sac.last_step
            assert stats is not None, "sac.last_step is None after a finished step"
            assert stats.step == step + 1, f"last_step.step={stats.step}, expected {step + 1}"
            check_stats(stats, policy if isinstance(policy, str) else "custom", expect_drop=expect_drop,
                        expect_replay=expect_replay, block_calls=block_calls)
            all_stats.append(stats)

            if opt is not None:
                opt.step()
                ref_opt.step()
                opt.zero_grad(set_to_none=True)
                ref_opt.zero_grad(set_to_none=True)
                assert_same_params(model, ref, what)
        return RefResult(sac, model, ref, loss, ref_loss, all_stats[-1], all_stats)
    finally:
        sac.close()
