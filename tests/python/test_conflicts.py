"""Conflict detection (conflicts.py): each setup in which tapesac would silently do nothing is warned once through
the `tapesac` logger, with what to do; training stays exact; the watch hooks leave no trace on a copied, pickled or
closed model. And the library's warnings all go through that logger.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

import models as M
from models import stack, x_in
from conftest import assert_same_grads, default_loss


def _warnings(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tapesac" and r.levelname == "WARNING" and needle in r.getMessage()]


def _hf_step(sac, model, ids) -> None:
    with sac.step():
        M.hf_loss(model, ids).backward()
    model.zero_grad(set_to_none=True)


def test_hf_gradient_checkpointing_is_warned_once(tapesac, caplog) -> None:
    model = M.hf_qwen3(2)
    ids = torch.randint(0, M.HF_VOCAB, (M.B, M.T))
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full")
    with caplog.at_level("WARNING", logger="tapesac"):
        _hf_step(sac, model, ids)
        assert not _warnings(caplog, "gradient checkpointing"), "warned without HF checkpointing on"
        model.gradient_checkpointing_enable()  # as Trainer(gradient_checkpointing=True) does when training starts
        _hf_step(sac, model, ids)
        _hf_step(sac, model, ids)
    found = _warnings(caplog, "Hugging Face gradient checkpointing is on")
    assert len(found) == 1, caplog.text
    assert "gradient_checkpointing_disable()" in found[0]
    assert sac.last_step.dropped_tensors == 0  # what the warning is about: tapesac saves nothing then
    sac.close()


class _Wrapped(nn.Module):
    """Blocks called through torch.utils.checkpoint by the model's own forward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = stack()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.inner.blocks:
            x = tuc.checkpoint(b, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant,needle", [(False, "saved-tensor hooks that are not tapesac's"),
                                              (True, "inside a backward pass")])
def test_block_inside_torch_checkpoint_is_warned(tapesac, caplog, reentrant: bool, needle: str) -> None:
    model = _Wrapped(reentrant)
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, blocks="inner.blocks.*", policy="full")
    x = x_in().detach().requires_grad_(True)
    with caplog.at_level("WARNING", logger="tapesac"):
        for _ in range(2):
            with sac.step():
                default_loss(model, (x,)).backward()
    assert len(_warnings(caplog, needle)) == 1, caplog.text
    default_loss(ref, (x,)).backward()
    sac.close()


def test_whole_model_compiled_before_the_first_step(tapesac, caplog, recorder_hook: str) -> None:
    """torch.compile(model) compiled and run before tapesac. Through at::RecordFunction the compiled code runs as it
    was compiled, without the blocks' hooks added later: no block call is recorded, and the step says so. Through
    the dispatch hook, dynamo's guard on the thread's dispatch key set (the hook's key is included during the step)
    makes it trace again inside the first step, with graph breaks at the blocks' hooks: the blocks are recorded and
    replayed, and the gradients are exact."""
    model = stack()
    ref = copy.deepcopy(model)
    x = x_in()
    compiled = torch.compile(model, backend="eager")
    compiled(x).sum().backward()  # compiled (and run) before tapesac
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        with caplog.at_level("WARNING", logger="tapesac"):
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                with sac.step():
                    compiled(x).sum().backward()
        found = _warnings(caplog, "recorded no block call")
        if recorder_hook == "record_function":
            assert sac.last_step.block_calls == 0
            assert len(found) == 1 and "torch.compile(model)" in found[0], caplog.text
        else:
            assert sac.last_step.block_calls == 2 and sac.last_step.ops_replayed > 0, sac.last_step
            assert not found, caplog.text
            ref(x).sum().backward()
            for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                assert torch.equal(p.grad, q.grad), name
    finally:
        sac.close()
        torch._dynamo.reset()


def test_model_compiled_in_place_is_warned_at_construction(tapesac, caplog) -> None:
    model = stack()
    model.compile(backend="eager")  # in place: nothing runs until the model is called
    with caplog.at_level("WARNING", logger="tapesac"):
        sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    found = _warnings(caplog, "is compiled as a whole")
    assert len(found) == 1 and "block.mlp.compile()" in found[0], caplog.text
    sac.close()


def test_compiled_inside_a_step_says_why(tapesac, caplog) -> None:
    """torch.compile tracing a block inside a step: the recording fails on FakeTensors, and the warning says so (it
    used to read "recording aten::add failed: ;" — torch's python_error has no message until persisted)."""
    model = M.hf_qwen3(1)
    ids = torch.randint(0, M.HF_VOCAB, (M.B, M.T))
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full")
    with caplog.at_level("WARNING", logger="tapesac"):
        with sac.step():
            compiled = torch.compile(model, backend="eager")
            M.hf_loss(compiled, ids).backward()
    errors = [b.capture_error for b in sac.last_step.blocks if b.capture_error]
    assert errors, "tracing inside the step recorded nothing wrong?"
    for e in errors:
        assert not re.search(r"failed: *$", e), e
        assert "FakeTensor" in e and "Compile before the first step" in e, e
    assert _warnings(caplog, "FakeTensor"), caplog.text
    sac.close()
    torch._dynamo.reset()


def test_second_tapesac_on_one_model_is_warned(tapesac, caplog) -> None:
    model = stack()
    with caplog.at_level("WARNING", logger="tapesac"):
        first = tapesac.TapeSAC(model, blocks="blocks.*")
        assert not _warnings(caplog, "another TapeSAC")
        second = tapesac.TapeSAC(model, blocks="blocks.*")
        found = _warnings(caplog, "another TapeSAC")
        assert len(found) == 1 and "close()" in found[0], caplog.text
        second.close()
        first.close()
        third = tapesac.TapeSAC(model, blocks="blocks.*")  # the others are closed: nothing to warn
        assert len(_warnings(caplog, "another TapeSAC")) == 1
        third.close()


def test_forward_and_backward_outside_a_step_is_warned_once(tapesac, caplog) -> None:
    model = stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    with caplog.at_level("WARNING", logger="tapesac"):
        with torch.no_grad():
            model(x_in())  # evaluation: no gradients, nothing to warn
        default_loss(model, (x_in(),))  # a forward with gradients but no backward: nothing trained
        assert not _warnings(caplog, "outside any step")
        with sac.step():
            default_loss(model, (x_in(),)).backward()
        assert not _warnings(caplog, "outside any step")
        default_loss(model, (x_in(),)).backward()
        default_loss(model, (x_in(),)).backward()
    found = _warnings(caplog, "outside any step")
    assert len(found) == 1 and "with sac.step():" in found[0] and "sac.attach(optimizer)" in found[0], caplog.text
    sac.close()


def test_watch_hooks_leave_no_trace_on_copies_pickles_and_exactness(tapesac, caplog) -> None:
    model = stack()
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    twin = copy.deepcopy(model)  # e.g. an EMA copy made after the TapeSAC
    restored = pickle.loads(pickle.dumps(model))
    with caplog.at_level("WARNING", logger="tapesac"):
        for m in (twin, restored):
            default_loss(m, (x_in(),)).backward()
    assert not caplog.records, caplog.text  # the copies are not this TapeSAC's blocks
    x = x_in().detach()
    with sac.step():
        default_loss(model, (x,)).backward()
    default_loss(ref, (x,)).backward()
    assert_same_grads(model, ref)
    sac.close()


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                                    for _ in range(2))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad)
        return x


def test_between_steps_the_blocks_carry_no_module_hook(tapesac) -> None:
    """Between steps no tapesac hook sits on a block: nn.TransformerEncoderLayer leaves its inference fast path
    whenever its modules have forward hooks, so the watch's forward hook changed an eval forward under no_grad while
    a TapeSAC existed (3.6e-7; a model making its own soft targets then trained on other numbers, under every policy),
    a deep copy made between steps kept the hook for good, and torch.jit.script failed on it (adversarial tests). The
    watch is a post-accumulate-grad hook on one trainable parameter per block: it sees a backward, not a forward."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    x = torch.randn(3, 7, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, -2:] = True
    with torch.no_grad():
        before = model(x, pad)
    sac = tapesac.TapeSAC(model, blocks="layers.*", policy="full")
    try:
        model.train()
        with sac.step():
            model(x, pad).square().mean().backward()
        model.eval()
        for name, m in model.named_modules():
            assert not m._forward_hooks and not m._forward_pre_hooks, name
        with torch.no_grad():
            assert torch.equal(model(x, pad), before)
        twin = copy.deepcopy(model)
        torch.jit.script(model)
    finally:
        sac.close()
    for name, m in twin.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, name
    for p in twin.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)


def test_library_warnings_go_through_the_tapesac_logger(tapesac) -> None:
    """No module of the library warns with warnings.warn or prints (the command-line modules print their output)."""
    root = Path(tapesac.__file__).parent
    cli = {"cli.py", "demo.py", "report_cli.py", "frontier_cli.py", "validate_cli.py"}
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.name in cli or rel.parts[0] == "bench":
            continue
        text = path.read_text()
        for pattern in (r"\bwarnings\.warn\(", r"(?<![\w.])print\("):
            if re.search(pattern, text):
                offenders.append(f"{rel}: {pattern}")
    assert not offenders, offenders


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_users_saved_tensor_hooks_around_the_forward_see_every_saved_tensor(tapesac, caplog, policy: str) -> None:
    """An adversarial test (Note [Hooks of others], hooks.py): a user's own lossy saved_tensors_hooks around the
    forward (activations packed as bf16) saw none of the blocks' saved tensors — tapesac's hooks, pushed at each
    block's entry, replaced them — and the gradients differed from plain PyTorch under every policy. Such blocks are
    left to the user's hooks now (warned once); the hooks see what they see without tapesac."""
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.to(torch.bfloat16) if t.dtype == torch.float32 else t

    def unpack(t):
        return t.to(torch.float32) if t.dtype == torch.bfloat16 else t

    def run(model, sac=None):
        packed.clear()
        x = x_in().detach().requires_grad_(True)
        with sac.step() if sac is not None else contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = default_loss(model, (x,))
            loss.backward()
        return [p.grad for p in model.parameters()], list(packed)

    model = stack(3)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    want, want_packed = run(ref)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    torch.manual_seed(1)
    with caplog.at_level("WARNING", logger="tapesac"):
        got, got_packed = run(model, sac)
    assert got_packed == want_packed
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(_warnings(caplog, "not tapesac's")) == 1, caplog.text
    sac.close()


class _LazyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.LazyLinear(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.out(torch.tanh(self.fc(x)) ** 2)


class _LazyNet(nn.Module):
    def __init__(self, initialised_first: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_LazyBlock() for _ in range(3)])
        if initialised_first:
            self.blocks[0](torch.zeros(1, 8))  # block 0 initialised, the others still lazy

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("initialised_first", [False, True])
def test_lazy_modules_are_watched_once_initialised_and_exact(tapesac, caplog, initialised_first: bool) -> None:
    """nn.Lazy* parameters before their first forward: TapeSAC(...) raised torch's untyped ValueError (the watch
    hooked an uninitialised parameter) and, with block 0 initialised, left block 0's watch hook behind (a helper's
    finding). Now such blocks are watched after the step that initialised them; the steps are exact."""
    torch.manual_seed(0)
    model = _LazyNet(initialised_first)
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, blocks=list(model.blocks), policy="full")
    try:
        for step in range(2):
            x = torch.randn(2, 5, 8)
            torch.manual_seed(10 + step)
            with sac.step():
                default_loss(model, (x,)).backward()
            torch.manual_seed(10 + step)
            default_loss(ref, (x,)).backward()
            assert_same_grads(model, ref)
            # the step that initialises a lazy block keeps its tensors (the parameter's storage is replaced while
            # it records, as a `.data` assignment would be: warned), later steps drop
            assert step == 0 or sac.last_step.dropped_tensors > 0
        assert len(sac._conflicts._handles) == 3  # every block watched now
        with caplog.at_level("WARNING", logger="tapesac"):
            default_loss(model, (torch.randn(2, 5, 8),)).backward()
        assert len(_warnings(caplog, "outside any step")) == 1, caplog.text
    finally:
        sac.close()
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
