"""Operators registered outside aten (torch.library custom ops, C++ extensions) inside recorded blocks.

Such an op is recorded as one opaque op: what its kernel calls runs below autograd and the recorder does not see it.
A kernel that draws random numbers from a generator (noise, stochastic rounding, a fused dropout such as
flash-attention's) carries no `nondeterministic_seeded` tag, so before 2026-12-07 its replay drew again from the
generator's *current* state: other numbers than the forward's (gradients off by 0.14 under `full`, an adversarial
test) and the global random stream advanced inside the backward (every later random op of the run shifted).
Now (Note [Random numbers drawn below a custom op], recorder.cpp) the recorder compares the device's default
generator before and after each such op; one that moved it is replayed from the state it started from, and the
generator is put back afterwards. An explicit `Generator` argument in the schema marks the op random outright.

Reference: a deep copy run without tapesac, loss, every gradient and the CPU RNG state bitwise equal
(conftest.reference_check).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import reference_check

pytestmark = pytest.mark.usefixtures("one_thread")

D = 8


@torch.library.custom_op("tapesac_custom::noisy", mutates_args=())
def _noisy(x: torch.Tensor) -> torch.Tensor:
    # torch.rand_like runs inside the kernel, below autograd: the recorder does not see it
    return x * torch.rand_like(x)


@_noisy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _noisy_backward(ctx, g: torch.Tensor) -> torch.Tensor:
    x, y = ctx.saved_tensors
    return g * y / x


def _noisy_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], output)  # its output is saved: "full" drops it and replays the op


_noisy.register_autograd(_noisy_backward, setup_context=_noisy_setup)


@torch.library.custom_op("tapesac_custom::noise_like", mutates_args=())
def _noise_like(x: torch.Tensor) -> torch.Tensor:
    # a factory inside the kernel (no tensor argument of its own)
    return torch.randn(x.shape) * 0.1


@_noise_like.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tapesac_custom::plain_scale", mutates_args=())
def _plain_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0  # draws nothing: replayed like any op, the generator untouched


@_plain_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_plain_scale.register_autograd(lambda ctx, g: g * 3.0)

_lib = torch.library.Library("tapesac_custom", "FRAGMENT")  # noqa: SIM115 - lives as long as the module
_lib.define("noisy_gen(Tensor x, Generator? generator) -> Tensor")


def _noisy_gen_cpu(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return x * torch.rand(x.shape, generator=generator)


_lib.impl("noisy_gen", _noisy_gen_cpu, "CPU")


class _NoisyGenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gen):
        y = torch.ops.tapesac_custom.noisy_gen(x, gen)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y / x, None


class _Block(nn.Module):
    def __init__(self, kind: str, gen: torch.Generator | None = None):
        super().__init__()
        self.kind = kind
        self.gen = gen
        self.fc = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "noisy":
            h = torch.tanh(_noisy(h))
        elif self.kind == "noise_like":
            h = torch.tanh(h + _noise_like(h.detach())) * torch.sigmoid(h)
        elif self.kind == "plain":
            h = torch.tanh(_plain_scale(h))
        elif self.kind == "generator":
            h = torch.tanh(_NoisyGenFn.apply(h, self.gen))
        elif self.kind == "twice":  # two draws in one block: each replayed from its own state
            h = torch.tanh(_noisy(h)) * torch.sigmoid(_noisy(h))
        return self.out(h) + x


class _Net(nn.Module):
    def __init__(self, kind: str, gen: torch.Generator | None = None):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(kind, gen) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _inputs():
    return (torch.randn(4, D),)


@pytest.mark.parametrize("kind", ["noisy", "noise_like", "plain", "twice"])
@pytest.mark.parametrize("policy,kwargs", [("full", {"schedule": "planned"}), ("full", {"schedule": "lazy"}),
                                           ("full", {"schedule": "one_segment"}), ({"aten::addmm"}, {}),
                                           ("full", {"backend": "emulated_graph"})])
def test_a_custom_op_drawing_random_numbers_replays_its_own_draws(kind: str, policy, kwargs: dict) -> None:
    reference_check(lambda: _Net(kind), _inputs, policy, lambda m: list(m.blocks), steps=3,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), sac_kwargs=kwargs, expect_replay=True)


def test_a_custom_op_with_a_generator_argument_replays_from_its_state() -> None:
    """The user's generator (not the default one) passed through the op's schema: replay uses a private copy at the
    recorded state, and the user's generator ends the step where the plain run left it."""
    import copy

    import tapesac

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    model = _Net("generator", gen)
    ref = copy.deepcopy(model)
    ref_gen = torch.Generator().manual_seed(7)
    for b in ref.blocks:
        b.gen = ref_gen
    sac = tapesac.TapeSAC(model, blocks=list(model.blocks), policy="full")
    try:
        for _ in range(2):
            x = torch.randn(4, D)
            ref(x).square().mean().backward()
            with sac.step():
                model(x).square().mean().backward()
            assert sac.last_step.ops_replayed > 0
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), name
            assert torch.equal(gen.get_state(), ref_gen.get_state())
            model.zero_grad()
            ref.zero_grad()
    finally:
        sac.close()


def test_a_custom_op_that_draws_nothing_leaves_the_generator_alone_at_replay() -> None:
    """A deterministic custom op is replayed like an aten op: the step's random stream is the plain run's (checked
    by the reference) and a random op after the backward draws what it would have drawn without tapesac."""
    import tapesac

    torch.manual_seed(0)
    model = _Net("plain")
    sac = tapesac.TapeSAC(model, blocks=list(model.blocks), policy="full")
    try:
        x = torch.randn(4, D)
        torch.manual_seed(5)
        with sac.step():
            model(x).square().mean().backward()
        after = torch.rand(3)
        torch.manual_seed(5)
        model(x).square().mean().backward()
        assert torch.equal(after, torch.rand(3))
        assert sac.last_step.ops_replayed > 0
    finally:
        sac.close()


class _Reregistered(nn.Module):
    """Calls tapesac_rereg::f, whatever the scoped library defining it is at the time."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(torch.ops.tapesac_rereg.f(self.fc(x))) + x


def _define_f(lib, scale: float) -> None:
    lib.define("f(Tensor x) -> Tensor")
    lib.impl("f", lambda x: x * scale + 1.0, "CPU")

    def setup(ctx, inputs, output):
        pass

    torch.library.register_autograd("tapesac_rereg::f", lambda ctx, g: g * scale, setup_context=setup, lib=lib)


def test_an_operator_registered_again_is_replayed_as_the_new_one() -> None:
    """Note [Operators deregistered] (op_info.cpp): a library that goes away takes its operators' dispatcher entries
    with it; the same name registered again (a notebook cell run twice, a scoped library per test) must be
    recorded and replayed as the new operator, never through the facts (and the freed handle) of the old one."""
    import tapesac

    for scale in (2.0, -3.0):
        with torch.library._scoped_library("tapesac_rereg", "DEF") as lib:
            _define_f(lib, scale)
            reference_check(_Reregistered, _inputs, "full", lambda m: [m], steps=2, expect_replay=True)
    assert tapesac is not None


class _NativeDropoutAtZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h, _ = torch.native_dropout(torch.tanh(self.fc(x)), 0.0, True)
        return self.out(h * h) + x


@pytest.mark.parametrize("backend", ["eager", "emulated_graph"])
def test_native_dropout_at_p_zero_draws_and_is_replayed_from_its_state(backend: str) -> None:
    """aten::native_dropout with p=0 in training draws from the CPU generator (bernoulli_ at 1.0) although it keeps
    every element: it is probed like a custom op (a helper's finding: a skipped p=0 replayed as deterministic moved
    the generator in the backward). The reference compares the RNG state after each step."""
    s = torch.get_rng_state()
    torch.native_dropout(torch.ones(3), 0.0, True)
    assert not torch.equal(s, torch.get_rng_state()), "the premise: native_dropout(p=0, train) draws on CPU"
    reference_check(_NativeDropoutAtZero, _inputs, "full", lambda m: [m], steps=2, expect_replay=True,
                    sac_kwargs={"backend": backend})
