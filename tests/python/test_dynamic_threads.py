"""Changing programs, threads and long runs.

- A tiny HF Qwen3 whose sequence length changes every step for 20 steps (with SGD): bitwise equal to a plain run
  at every step.
- A tiny HF Qwen3-MoE whose routing changes every step (new inputs each step; the test checks the selected
  experts really differ): bitwise equal at every step, for the default and the eager (index_add_) experts.
- Two models trained in two threads, each with its own TapeSAC, forced to overlap with barriers (forward of one
  during the backward of the other, and the reverse), with a short GIL switch interval: both bitwise equal to
  their plain runs.
- A thread drawing random numbers while another thread's backward replays dropout: replay must not be disturbed
  by (or disturb) the process-wide generator.
- 500 steps of a small model: the number of live tensors, the storages of every block intermediate and (with
  tapesac.MemoryMeter) the bytes alive after each step and the per-step peak stay flat; the process RSS does not
  grow with the number of steps.
"""

from __future__ import annotations

import copy
import gc
import sys
import threading
from typing import Any

import pytest
import torch
import torch.nn as nn

import models as M
from conftest import assert_same_grads, assert_same_tensor, reference_check
from robust_helpers import assert_exact_step, live_tensor_count, small_input, small_stack

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_qwen3(**kw) -> nn.Module:
    import tapesac.models as TM

    return TM.tiny_qwen3(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128, **kw)


def tiny_qwen3_moe(**kw) -> nn.Module:
    import tapesac.models as TM

    return TM.tiny_qwen3_moe(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=128, **kw)


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


# ----------------------------------------------------------------------------------------------------------------------
# Dynamic shapes and routing
# ----------------------------------------------------------------------------------------------------------------------

SEQ_LENS = [7, 16, 3, 33, 12, 13, 25, 8, 40, 2, 19, 5, 31, 11, 64, 4, 17, 9, 28, 6]  # 20 steps, every one different (T >= 2: T=1 has no next-token target)


@pytest.mark.parametrize("policy", ["full", "none", frozenset({"aten::mm", "aten::bmm"})], ids=["full", "none", "save_mm"])
def test_qwen3_sequence_length_changes_every_step(policy: Any) -> None:
    calls = []

    def inputs():
        t = SEQ_LENS[len(calls) // 2]  # called once for the plain run and once for tapesac per step
        calls.append(t)
        return torch.randint(0, VOCAB, (2, t))

    res = reference_check(tiny_qwen3, inputs, policy, "model.layers.*", hf_loss, steps=len(SEQ_LENS),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), block_calls=2,
                          expect_drop=None if policy != "full" else True)
    assert calls == [t for t in SEQ_LENS for _ in range(2)], calls
    recorded = [s.ops_recorded for s in res.all_stats]
    assert all(r > 0 for r in recorded), recorded
    if policy == "full":
        # The dropped bytes follow the sequence length: each step really ran at its own shape.
        dropped = [s.dropped_bytes for s in res.all_stats]
        order = sorted(range(len(SEQ_LENS)), key=lambda i: SEQ_LENS[i])
        assert [dropped[i] for i in order] == sorted(dropped), list(zip(SEQ_LENS, dropped))


class _RouteRecorder:
    """Forward hooks on every MoE router: the experts each token was sent to, per call."""

    def __init__(self, model: nn.Module):
        self.calls: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._hook) for n, m in model.named_modules()
                        if type(m).__name__.endswith("TopKRouter")]
        assert self.handles, "no MoE router module found: the model changed, update the test"

    def _hook(self, _m, _args, out):
        self.calls.append(out[2].detach().clone())  # (logits, scores, indices)

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("experts", [None, "eager"], ids=["default_experts", "eager_experts"])
@pytest.mark.parametrize("policy", ["full", "none"])
def test_qwen3_moe_routing_changes_every_step(experts: str | None, policy: str) -> None:
    steps = 8
    routes: list[tuple] = []
    recorders = []

    def make_model():
        return tiny_qwen3_moe(experts_implementation=experts)

    def inputs():
        return torch.randint(0, VOCAB, (2, 12))

    def loss_fn(model, ids):
        rec = _RouteRecorder(model)
        try:
            loss = hf_loss(model, ids)
        finally:
            rec.remove()
        recorders.append(rec)
        return loss

    res = reference_check(make_model, inputs, policy, "model.layers.*", loss_fn, steps=steps,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.5), block_calls=2)
    # recorders alternate plain, tapesac per step; the tapesac run routed exactly like the plain run.
    for i in range(steps):
        plain, sac = recorders[2 * i], recorders[2 * i + 1]
        assert len(plain.calls) == len(sac.calls) == 2
        for a, b in zip(plain.calls, sac.calls):
            assert torch.equal(a, b), f"step {i + 1}: routing differs between the plain and the tapesac run"
        routes.append(tuple(tuple(sorted(set(c.flatten().tolist()))) + tuple(c.flatten().tolist()) for c in sac.calls))
    assert len(set(routes)) == steps, "routing did not change from step to step: the test would not cover it"
    assert all(st.ops_recorded > 0 for st in res.all_stats), res.all_stats


# ----------------------------------------------------------------------------------------------------------------------
# Threads
# ----------------------------------------------------------------------------------------------------------------------


class _Phases:
    """Runs two threads in lockstep: at each tick both threads do their phase k, then wait on the barrier."""

    def __init__(self, n_threads: int = 2, timeout: float = 60.0):
        self.barrier = threading.Barrier(n_threads, timeout=timeout)
        self.errors: list[tuple[str, BaseException]] = []

    def run(self, targets: dict[str, Any]) -> None:
        threads = [threading.Thread(target=self._wrap, args=(name, fn), name=name, daemon=True)
                   for name, fn in targets.items()]
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # switch the GIL often: interleave the threads' Python-level hooks
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
                assert not t.is_alive(), f"thread {t.name} did not finish (deadlock?)"
        finally:
            sys.setswitchinterval(old)
        if self.errors:
            name, e = self.errors[0]
            raise AssertionError(f"thread {name} failed: {type(e).__name__}: {e}") from e

    def _wrap(self, name, fn):
        try:
            fn(self.tick)
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            self.errors.append((name, e))
            self.barrier.abort()

    def tick(self):
        self.barrier.wait()


def _trainer(model: nn.Module, make_input, loss_fn, steps: int, policy: Any, lead: bool, results: dict, key: str):
    """A training loop with a barrier tick between forward and backward. The `lead` thread does its forward while
    the other does its backward (and the reverse), so that each phase overlaps each phase of the other thread."""
    import tapesac

    def run(tick):
        sac = tapesac.TapeSAC(model, blocks="blocks.*" if hasattr(model, "blocks") else "model.layers.*",
                              policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, grads, stats = [], [], []
        try:
            if not lead:
                tick()
            for step in range(steps):
                with sac.step():
                    loss = loss_fn(model, make_input(step))
                    tick()
                    loss.backward()
                    tick()
                losses.append(loss.detach())
                grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
                stats.append(sac.last_step)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if lead:
                tick()
        finally:
            sac.close()
        results[key] = (losses, grads, stats)
    return run


def _plain(model: nn.Module, make_input, loss_fn, steps: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for step in range(steps):
        loss = loss_fn(model, make_input(step))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _ids(seed_base: int, t: int):
    def make(step):
        g = torch.Generator().manual_seed(seed_base + step)
        return torch.randint(0, VOCAB, (2, t + step % 3), generator=g)  # the shape changes too
    return make


def _xs(seed_base: int, d: int):
    def make(step):
        g = torch.Generator().manual_seed(seed_base + step)
        return torch.randn(2, 8, d, generator=g)
    return make


def _stack_no_random() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return M.Stack([M.MLPBlock(32, 64), M.InplaceBlock(32), M.AttentionBlock(32, heads=2), M.MultiOutputBlock(32)])


@pytest.mark.parametrize("policies", [("full", "full"), ("full", "none")], ids=["full+full", "full+none"])
def test_two_models_in_two_threads(policies) -> None:
    """No random ops (the CPU generator is process-wide, so concurrent dropout would differ even without tapesac)."""
    steps = 6
    qwen = tiny_qwen3(seed=3)
    stack = _stack_no_random()
    specs = {
        "qwen3": (qwen, _ids(100, 10), hf_loss),
        "stack": (stack, _xs(200, 32), lambda m, x: m(x).square().mean()),
    }
    refs = {k: _plain(copy.deepcopy(m), mi, lf, steps) for k, (m, mi, lf) in specs.items()}
    results: dict = {}
    phases = _Phases(2)
    phases.run({k: _trainer(m, mi, lf, steps, pol, lead=i == 0, results=results, key=k)
                for i, ((k, (m, mi, lf)), pol) in enumerate(zip(specs.items(), policies))})
    for k in specs:
        losses, grads, stats = results[k]
        ref_losses, ref_grads = refs[k]
        for step in range(steps):
            assert_same_tensor(f"{k} step {step + 1}: loss", losses[step], ref_losses[step])
            assert grads[step].keys() == ref_grads[step].keys()
            for n in ref_grads[step]:
                assert_same_tensor(f"{k} step {step + 1}: grad of {n}", grads[step][n], ref_grads[step][n])
            assert stats[step].ops_recorded > 0, stats[step]
        if policies[list(specs).index(k)] == "full":
            assert all(s.dropped_tensors > 0 and s.ops_replayed > 0 for s in stats), stats


def test_many_threads_each_with_own_instance() -> None:
    """Four threads, one model and one TapeSAC each, all stepping at once (barrier before every step)."""
    n, steps = 4, 4
    models = [_stack_no_random() for _ in range(n)]
    refs = [_plain(copy.deepcopy(m), _xs(300 + 10 * i, 32), lambda m, x: m(x).square().mean(), steps)
            for i, m in enumerate(models)]
    results: dict = {}
    phases = _Phases(n)
    phases.run({f"t{i}": _trainer(m, _xs(300 + 10 * i, 32), lambda m, x: m(x).square().mean(), steps, "full",
                                  lead=True, results=results, key=i)
                for i, m in enumerate(models)})
    for i in range(n):
        losses, grads, _ = results[i]
        for step in range(steps):
            assert_same_tensor(f"thread {i} step {step + 1}: loss", losses[step], refs[i][0][step])
            for name, g in refs[i][1][step].items():
                assert_same_tensor(f"thread {i} step {step + 1}: grad of {name}", grads[step][name], g)


class _DropoutChain(nn.Module):
    """fc -> 8 x tanh(dropout(.)): eight random ops whose masks replay must reproduce."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        for _ in range(8):
            h = torch.tanh(torch.nn.functional.dropout(h, 0.3, training=self.training))
        return h


@pytest.mark.parametrize("contract", ["check", "strict"])
def test_replay_of_dropout_while_another_thread_draws_random_numbers(contract: str) -> None:
    """While thread A's backward replays its dropout masks, thread B draws from the process-wide CPU generator.
    In a plain run B cannot change A's gradients (backward draws nothing) and never sees the same numbers twice.
    With tapesac, replay must reproduce A's masks without racing B for the shared generator (else A's gradient is
    wrong, or under "strict" the step fails), and must not rewind the generator under B's feet (else B draws the
    same numbers again). Repro: /tmp/robust_repros/replay_rewinds_other_threads_rng.py (see the report)."""
    import tapesac

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = M.Stack([_DropoutChain(), _DropoutChain()])
    ref = copy.deepcopy(model)
    stop = threading.Event()
    seen: set = set()
    duplicates = [0]

    def drawer():
        while not stop.is_set():
            v = torch.rand(64)
            key = (v[0].item(), v.sum().item())
            duplicates[0] += key in seen
            seen.add(key)

    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full", contract=contract)
    wrong = []
    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(1e-6)  # hand the GIL over often, so the drawer runs while replay runs
        for step in range(40):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            g = torch.Generator().manual_seed(40 + step)
            x = torch.randn(16, 256, generator=g)
            torch.manual_seed(step)
            ref(x).square().mean().backward()
            torch.manual_seed(step)
            t = threading.Thread(target=drawer, daemon=True)
            with sac.step():
                loss = model(x).square().mean()  # the forward alone: its masks are deterministic
                stop.clear()
                t.start()
                try:
                    loss.backward()
                finally:
                    stop.set()
                    t.join(30)
            replayed = sac.last_step.ops_replayed_by_name
            assert {"aten::native_dropout", "aten::bernoulli_.float"} & set(replayed), replayed
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                if not torch.equal(p.grad, q.grad):
                    wrong.append(f"step {step + 1}: grad of {n}")
        assert len(seen) > 100, f"the drawing thread drew only {len(seen)} times during 12 backwards"
        assert duplicates[0] == 0 and not wrong, (
            f"another thread drew the same random numbers again {duplicates[0]} times (of {len(seen)} draws), and "
            f"{len(wrong)} gradients differ from the plain run ({wrong[:3]}): replay sets and restores the "
            f"process-wide generator while other threads draw from it")
    finally:
        sys.setswitchinterval(old)
        stop.set()
        sac.close()


class _OtherThreadDrawsBeforeRandomOps:
    """A TorchDispatchMode (built lazily) that, when it sees a random op, makes another thread draw from the CPU
    generator and waits for it: the interleaving of the race above, forced at the worst moment (after replay
    set the generator to the recorded state, before the op draws). Used only around the backward."""

    RANDOM = ("native_dropout", "bernoulli", "rand", "normal", "uniform")

    @classmethod
    def make(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            forced = 0
            draw = True

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(r in func.__name__ for r in cls.RANDOM):
                    Mode.forced += 1
                    if self.draw:
                        t = threading.Thread(target=lambda: torch.rand(1000))
                        t.start()
                        t.join()
                return func(*args, **(kwargs or {}))

        return Mode()


@pytest.mark.parametrize("other_thread_draws", [False, True], ids=["control_no_draw", "other_thread_draws"])
def test_replay_random_op_with_a_forced_draw_from_another_thread(other_thread_draws: bool) -> None:
    """Deterministic form of the test above. Plain backward draws no random numbers, so another thread drawing
    during it cannot change gradients; the replayed dropout must draw its recorded numbers regardless. The control
    (the same dispatch mode, no draw) shows that the mode itself does not disturb replay.
    Repro: /tmp/robust_repros/replay_rng_race_deterministic.py."""
    import tapesac

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = M.Stack([_DropoutChain(32), _DropoutChain(32)])
    ref = copy.deepcopy(model)
    x = torch.randn(8, 32)
    torch.manual_seed(0)
    ref(x).square().mean().backward()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    mode = _OtherThreadDrawsBeforeRandomOps.make()
    mode.draw = other_thread_draws
    try:
        torch.manual_seed(0)
        with sac.step():
            loss = model(x).square().mean()
            with mode:
                loss.backward()
        assert mode.forced > 0, "the dispatch mode saw no replayed random op: the test exercises nothing"
    finally:
        sac.close()
    assert_same_grads(model, ref)


# ----------------------------------------------------------------------------------------------------------------------
# Long run
# ----------------------------------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_500_steps_flat_memory() -> None:
    """500 steps (SGD) of a 3-block stack with dropout under policy "full": live tensors, intermediate storages,
    bytes alive after each step and the per-step peak stay flat (MemoryMeter), RSS does not grow
    with the step count, and the last step is still bitwise exact."""
    import tapesac

    from robust_helpers import StorageTracker

    model = small_stack(n=2, dropout=True)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tracker = StorageTracker()
    tracker.track_all_leaves(model)
    live, rss, after_bytes, peaks = {}, {}, [], []
    x = small_input(seed=1).detach()

    def one_step():
        with sac.step():
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for step in range(1, 501):
            tracker.refs.clear()
            if step > 20:
                with tapesac.MemoryMeter() as m:
                    one_step()
                    after_bytes.append(m.current_bytes)
                    peaks.append(m.peak_bytes)
            else:
                one_step()
            assert tracker.alive() == [], f"step {step}: module outputs still alive after the step: {tracker.alive()}"
            if step in (50, 100, 250, 500):
                live[step] = live_tensor_count()
                rss[step] = _rss_bytes()
        assert len(set(live.values())) == 1, f"live tensors (gc) by step: {live}"
        growth = rss[500] - rss[100]
        # RSS is noisy (glibc arenas, the interpreter); a leak of one tape (hundreds of ops) per step would add
        # tens of MiB over 400 steps.
        assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB from step 100 to 500: {rss}"
        assert set(after_bytes) == {0}, f"bytes alive after a step (should be 0): {sorted(set(after_bytes))}"
        assert max(peaks[-100:]) <= max(peaks[:100]), (
            f"the step peak grows: first 100 steps max {max(peaks[:100])}, last 100 max {max(peaks[-100:])}")
        # From the second step on: the first measures the unpack order that "full"'s planned replay schedules follow.
        stats = [s for s in sac.history if s.step > 1]
        assert len({(s.ops_recorded, s.saved_tensors, s.dropped_bytes, s.ops_replayed) for s in stats}) == 1, (
            "identical steps produced different statistics")
    finally:
        tracker.remove()
        sac.close()
    assert_exact_step(None, model, when="a step after the 500-step run")
