"""Hypothesis fuzzing of the public API: random constructor arguments and random call orders.

Rules checked for every example:
- the only exceptions are documented tapesac errors (tapesac.TapeSACError and subclasses) with a non-empty message,
  or the very exception object the test itself injected (a user exception, a KeyboardInterrupt);
- a documented misuse gets its documented error (a step inside a step, a step after close: TapeSACError);
- afterwards no module hook is left on the model (every hook dict as before), no saved-tensor hook is installed,
  grad mode is on, and a following correct step (the same TapeSAC if still open, then a fresh one) gives loss and
  gradients bitwise equal to a plain run.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import models as M
from robust_helpers import (assert_exact_step, assert_hooks_unchanged, assert_no_saved_tensor_hooks,
                            assert_no_tapesac_hooks,
                            hook_snapshot, small_input, small_stack)
from conftest import assert_same_grads, assert_same_tensor

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


pytestmark = pytest.mark.usefixtures("one_thread")


class Injected(Exception):
    """An exception the test raises itself: it must come out unchanged."""


def _documented(e: BaseException, injected: BaseException | None = None) -> None:
    import tapesac

    if injected is not None and e is injected:
        return
    if not isinstance(e, tapesac.TapeSACError):
        raise AssertionError(f"undocumented exception type {type(e).__module__}.{type(e).__name__}: {e!r}") from e
    assert str(e).strip(), f"{type(e).__name__} with an empty message"


# Per argument: (label, value or factory(model) -> value), valid and invalid. Labels make hypothesis' falsifying
# examples readable. "Valid" means documented as accepted today; an invalid value must raise a documented error
# (the test also accepts a later version accepting it, as long as the step is then exact).
def _m(f):
    f.factory = True
    return f


VALID = {
    "model": [("model", _m(lambda m: m))],
    "blocks": [("'blocks.*'", "blocks.*"), ("ModuleList", _m(lambda m: m.blocks)), ("list", _m(lambda m: list(m.blocks))),
               ("tuple", _m(lambda m: tuple(m.blocks))), ("class MLPBlock", M.MLPBlock), ("'MLPBlock'", "MLPBlock"),
               ("'blocks.1'", "blocks.1"), ("one module", _m(lambda m: m.blocks[0])),
               ("the model itself", _m(lambda m: m)), ("nested list", _m(lambda m: [m.blocks[0], m.blocks[0].fc1])),
               ("'blocks.*.fc1'", "blocks.*.fc1"), ("''", "")],
    "policy": [("'full'", "full"), ("'none'", "none"), ("{'aten::addmm'}", {"aten::addmm"}),
               ("frozenset(mm, gelu)", frozenset({"aten::mm", "aten::gelu"})),
               ("[torch.ops.aten.addmm]", [torch.ops.aten.addmm]), ("(aten.gelu.default,)", (torch.ops.aten.gelu.default,)),
               ("['aten.addmm.default']", ["aten.addmm.default"]), ("set()", set()),
               ("callable keep gelu", lambda op: op == "aten::gelu"), ("callable -> None", lambda op: None),
               ("callable -> tensor", lambda op: torch.ones(3)), ("callable raises", lambda op: 1 / 0)],
    "contract": [("check", "check"), ("strict", "strict"), ("off", "off")],
    "backend": [("auto", "auto"), ("eager", "eager")],
    "memory_limit": [("None", None)],
    "approx": [("None", None), ("Approx()", _m(lambda m: __import__("tapesac").Approx())),
               ("Approx(0.5, greedy)", _m(lambda m: __import__("tapesac").Approx(fraction=0.5, method="greedy")))],
}
INVALID = {
    "model": [("None", None), ("'model'", "model"), ("tensor", torch.randn(2)), ("function", lambda x: x),
              ("class Stack", M.Stack), ("ModuleList factory", _m(lambda m: [m]))],
    "blocks": [("None", None), ("3", 3), ("3.5", 3.5), ("b'blocks.*'", b"blocks.*"), ("'nope.*'", "nope.*"), ("[]", []),
               ("foreign module", _m(lambda m: [nn.Linear(2, 2)])), ("[module, 'x']", _m(lambda m: [m.blocks[0], "x"])),
               ("dict", _m(lambda m: {"blocks": m.blocks})), ("class Conv2d", nn.Conv2d), ("class int", int),
               ("object()", object()), ("set of modules", _m(lambda m: {m.blocks[0]})), ("'blocks.9'", "blocks.9")],
    "policy": [("'auto'", "auto"), ("'fulll'", "fulll"), ("''", ""), ("None", None), ("3", 3), ("0.5", 0.5),
               ("object()", object()), ("{'notanop'}", {"notanop"}), ("{3}", {3}), ("[['aten::mm']]", [["aten::mm"]]),
               ("dict", {"aten::mm": True}), ("b'full'", b"full"), ("'FULL'", "FULL"), ("{'a.b.c.d'}", {"a.b.c.d"})],
    "contract": [("'CHECK'", "CHECK"), ("''", ""), ("None", None), ("1", 1), ("['check']", ["check"]),
                 ("'sometimes'", "sometimes"), ("True", True)],
    "backend": [("'cuda_graph'", "cuda_graph"), ("'tpu'", "tpu"), ("None", None), ("0", 0), ("''", ""),
                ("['auto']", ["auto"]), ("'EAGER'", "EAGER")],
    "memory_limit": [("'20GiB'", "20GiB"), ("'90%'", "90%"), ("0", 0), ("-1", -1), ("1", 1), ("10**12", 10**12),
                     ("1.5", 1.5), ("'abc'", "abc"), ("'0GiB'", "0GiB"), ("'-5MiB'", "-5MiB"), ("[1]", [1]),
                     ("nan", float("nan")), ("True", True)],
    "approx": [("'sketch'", "sketch"), ("0.5", 0.5), ("True", True), ("dict", {"fraction": 0.5}),
               ("class Approx", _m(lambda m: __import__("tapesac").Approx)), ("object()", object())],
}
ARGS = list(VALID)


def _value(entry, model):
    _, v = entry
    return v(model) if getattr(v, "factory", False) else v


@FUZZ
@given(data=st.data(), invalid=st.sets(st.sampled_from(ARGS), max_size=2),
       omit=st.sets(st.sampled_from(ARGS[1:]), max_size=3))
def test_random_constructor_arguments(data, invalid, omit) -> None:
    """Mostly valid arguments with 0-2 invalid ones (and some omitted, i.e. defaults)."""
    import tapesac

    model = small_stack()
    ref = copy.deepcopy(model)
    before = hook_snapshot(model)
    chosen = {a: data.draw(st.sampled_from(INVALID[a] if a in invalid else VALID[a]), label=a) for a in ARGS}
    kwargs = {a: _value(e, model) for a, e in chosen.items() if a not in omit and a != "model"}
    sac = None
    try:
        sac = tapesac.TapeSAC(_value(chosen["model"], model), **kwargs)
    except BaseException as e:  # noqa: BLE001 - the point is to classify every exception
        _documented(e)
        event(f"constructor raised {type(e).__name__}")
    else:
        event("constructor accepted" + (" an invalid value" if invalid - omit else ""))
    assert_hooks_unchanged(model, before, "after the constructor")
    if sac is None:  # a constructor that raised left nothing behind, not even the between-steps watch
        assert_no_tapesac_hooks(model, "after a constructor that raised")
    if sac is not None:
        assert "model" not in invalid, f"TapeSAC accepted {chosen['model'][0]} as the model"
        exact = kwargs.get("approx") is None  # an accepted Approx is not exact by design
        try:
            _step_or_documented(sac, model, ref, exact)
            _step_or_documented(sac, model, ref, exact)  # a second step: no state from the first leaks
        finally:
            sac.close()
            sac.close()
    assert_hooks_unchanged(model, before, "after close()")
    assert_no_tapesac_hooks(model, "after close()")
    assert_no_saved_tensor_hooks("after the example")
    assert_exact_step(None, model, ref=ref, when="a fresh TapeSAC after the example")


def _step_or_documented(sac, model, ref, exact: bool) -> None:
    try:
        if exact:
            assert_exact_step(sac, model, ref=ref, expect_drop=False, when="the first step")
        else:
            with sac.step():
                model(small_input()).square().mean().backward()
    except AssertionError:
        raise
    except BaseException as e:  # noqa: BLE001
        _documented(e)
    assert_no_saved_tensor_hooks("after a step")


# ----------------------------------------------------------------------------------------------------------------------
# Random call orders
# ----------------------------------------------------------------------------------------------------------------------


class Harness:
    """One model, its plain twin, one TapeSAC; each action checks what it must and records what happened."""

    def __init__(self, policy: Any, contract: str):
        import tapesac

        self.tapesac = tapesac
        self.model = small_stack()
        self.ref = copy.deepcopy(self.model)
        self.before = hook_snapshot(self.model)
        self.policy = policy
        self.sac = tapesac.TapeSAC(self.model, blocks="blocks.*", policy=policy, contract=contract)
        self.closed = False
        self.steps = 0
        self.log: list[str] = []
        self.seed = 100

    def _losses(self):
        self.seed += 1
        self.model.zero_grad(set_to_none=True)
        self.ref.zero_grad(set_to_none=True)
        x, xr = small_input(seed=self.seed), small_input(seed=self.seed)
        torch.manual_seed(self.seed)
        ref_loss = self.ref(xr).square().mean()
        return x, xr, ref_loss

    def _compare(self, loss, ref_loss, x, xr, what):
        assert_same_tensor(f"{what}: loss", loss.detach(), ref_loss.detach())
        assert_same_grads(self.model, self.ref, f"{what}: ")
        assert_same_tensor(f"{what}: input grad", x.grad, xr.grad)

    def _expect_closed_refusal(self, fn) -> bool:
        """After close(), entering a step raises TapeSACError (documented); returns True if it was refused."""
        if not self.closed:
            return False
        with pytest.raises(self.tapesac.TapeSACError) as ei:
            fn()
        assert str(ei.value).strip()
        return True

    # -- actions ---------------------------------------------------------------------------------------------
    def step(self):
        if self._expect_closed_refusal(lambda: self.sac.step().__enter__()):
            return
        assert_exact_step(self.sac, self.model, ref=self.ref, policy=self.policy, expect_drop=False,
                          seed=self.seed, when=f"action step after {self.log}")
        self.steps += 1

    def step_raises(self):
        err = Injected("raised inside the step")

        def body():
            with self.sac.step():
                self.model(small_input()).square().mean()
                raise err
        if self._expect_closed_refusal(body):
            return
        with pytest.raises(Injected) as ei:
            body()
        assert ei.value is err
        self.steps += 1

    def keyboard_interrupt(self):
        err = KeyboardInterrupt()

        def body():
            with self.sac.step():
                h = self.model.blocks[0](small_input())
                self.model.blocks[1](h)
                raise err
        if self._expect_closed_refusal(body):
            return
        with pytest.raises(KeyboardInterrupt) as ei:
            body()
        assert ei.value is err
        self.steps += 1

    def raise_in_block_forward(self):
        err = Injected("raised by a forward hook inside a block")

        def hook(*_):
            raise err
        h = self.model.blocks[1].fc2.register_forward_hook(hook)
        try:
            def body():
                with self.sac.step():
                    self.model(small_input()).square().mean().backward()
            if self._expect_closed_refusal(body):
                return
            with pytest.raises(Injected) as ei:
                body()
            assert ei.value is err
            self.steps += 1
        finally:
            h.remove()

    def raising_backward_hook(self):
        err = Injected("raised by a tensor hook during backward")

        def body():
            with self.sac.step():
                h = self.model.blocks[0](small_input())
                h.register_hook(lambda g: (_ for _ in ()).throw(err))
                for blk in self.model.blocks[1:]:
                    h = blk(h)
                h.square().mean().backward()
        if self._expect_closed_refusal(body):
            return
        with pytest.raises(Injected) as ei:
            body()
        assert ei.value is err
        self.steps += 1

    def nested_step(self):
        def outer():
            with self.sac.step():
                with pytest.raises(self.tapesac.TapeSACError) as ei:
                    with self.sac.step():
                        pass
                assert str(ei.value).strip()
                x, xr, ref_loss = self._losses()
                ref_loss.backward()
                torch.manual_seed(self.seed)
                loss = self.model(x).square().mean()
                loss.backward()
            self._compare(loss, ref_loss, x, xr, "after a refused nested step")
        if self._expect_closed_refusal(outer):
            return
        outer()
        self.steps += 1

    def nested_other_instance(self):
        other = self.tapesac.TapeSAC(self.model, blocks="blocks.*", policy="full")
        try:
            if self.closed:
                with pytest.raises(self.tapesac.TapeSACError):
                    self.sac.step().__enter__()
                return
            with self.sac.step():
                with pytest.raises(self.tapesac.TapeSACError) as ei:
                    with other.step():
                        pass
                assert str(ei.value).strip()
            self.steps += 1
        finally:
            other.close()

    def backward_outside_step(self):
        """The graph is built inside a step and its backward runs after the step ended: either the documented
        TapeSACError or, if nothing had to be replayed, a correct gradient."""
        if self.closed:
            return self.step()
        x, xr, ref_loss = self._losses()
        ref_loss.backward()
        torch.manual_seed(self.seed)
        with self.sac.step():
            loss = self.model(x).square().mean()
        self.steps += 1
        try:
            loss.backward()
        except BaseException as e:  # noqa: BLE001
            # Documented: "the backward of a step must run inside `with sac.step():`" (also under "none", where
            # the kept tensors are released when the step ends).
            _documented(e)
            assert "step" in str(e).lower(), f"the error does not say the backward belongs in the step: {e}"
            return
        self._compare(loss, ref_loss, x, xr, "backward outside the step")

    def retain_graph_twice(self):
        if self.closed:
            return self.step()
        x, xr, ref_loss = self._losses()
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        torch.manual_seed(self.seed)
        with self.sac.step():
            loss = self.model(x).square().mean()
            loss.backward(retain_graph=True)
            loss.backward()
        self.steps += 1
        self._compare(loss, ref_loss, x, xr, "two backwards in one step")

    def no_backward(self):
        if self._expect_closed_refusal(lambda: self.sac.step().__enter__()):
            return
        with self.sac.step():
            loss = self.model(small_input()).square().mean()
            del loss
        self.steps += 1

    def no_grad_step(self):
        if self._expect_closed_refusal(lambda: self.sac.step().__enter__()):
            return
        with self.sac.step():
            with torch.no_grad():
                self.model(small_input())
        self.steps += 1

    def plain_outside(self):
        x, xr, ref_loss = self._losses()
        ref_loss.backward()
        torch.manual_seed(self.seed)
        loss = self.model(x).square().mean()
        loss.backward()
        self._compare(loss, ref_loss, x, xr, "a plain step outside tapesac")
        assert_no_saved_tensor_hooks("a plain step outside tapesac")

    def report(self):
        rep = self.sac.report()
        d = rep.to_dict()
        assert isinstance(d, dict) and d.get("schema_version") is not None, d
        assert isinstance(rep.pretty(), str) and rep.pretty()
        assert rep.steps == len(self.sac.history), (rep.steps, len(self.sac.history))
        last = self.sac.last_step
        assert (last is None) == (self.steps == 0), (last, self.steps)

    def close(self):
        self.sac.close()
        self.closed = True

    def close_twice(self):
        self.sac.close()
        self.sac.close()
        self.closed = True


ACTIONS = [name for name in vars(Harness) if not name.startswith("_")]


@FUZZ
@given(actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=7),
       policy=st.sampled_from(["full", "none", "save_addmm"]), contract=st.sampled_from(["check", "strict", "off"]))
def test_random_call_orders(actions: list[str], policy: str, contract: str) -> None:
    pol = {"save_addmm": {"aten::addmm"}}.get(policy, policy)
    h = Harness(pol, contract)
    try:
        for a in actions:
            h.log.append(a)
            getattr(h, a)()  # each action expects its own documented errors; anything else fails the test
            assert_hooks_unchanged(h.model, h.before, f"after actions {h.log}")
            assert_no_saved_tensor_hooks(f"after actions {h.log}")
        if not h.closed:
            assert_exact_step(h.sac, h.model, ref=h.ref, policy=pol, expect_drop=False,
                              when=f"a correct step after {h.log}")
    finally:
        h.sac.close()
    assert_hooks_unchanged(h.model, h.before, f"after close following {h.log}")
    assert_no_tapesac_hooks(h.model, f"after close following {h.log}")
    assert_no_saved_tensor_hooks(f"after close following {h.log}")
    assert_exact_step(None, h.model, ref=h.ref, when=f"a fresh TapeSAC after {h.log}")


def test_every_action_is_exercised() -> None:
    """The call-order fuzz reaches every action (hypothesis could otherwise skew away from some)."""
    assert set(ACTIONS) >= {"step", "step_raises", "keyboard_interrupt", "raise_in_block_forward",
                            "raising_backward_hook", "nested_step", "nested_other_instance", "backward_outside_step",
                            "retain_graph_twice", "no_backward", "no_grad_step", "plain_outside", "report", "close",
                            "close_twice"}
    for a in ACTIONS:  # each action once, then a correct step: a deterministic floor under the random orders
        h = Harness("full", "check")
        try:
            h.log.append(a)
            getattr(h, a)()
            assert_hooks_unchanged(h.model, h.before, f"after {a}")
            assert_no_saved_tensor_hooks(f"after {a}")
            if not h.closed:
                assert_exact_step(h.sac, h.model, ref=h.ref, expect_drop=True, when=f"a correct step after {a}")
        finally:
            h.sac.close()
