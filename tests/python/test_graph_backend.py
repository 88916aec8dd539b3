"""The graph replayer end to end on CPU, through backend="emulated_graph".

The emulated device (replay/graph_emulation.h) captures a block's replayable ops once, keeps every value at a fixed
address and re-runs only the enabled ops at each launch, so a replay that forgot to stage a kept value, enabled too
few nodes or read a stale buffer gives a wrong gradient here exactly as it would on a CUDA graph. Every scenario of
the reference test runs three steps with graph replay and must stay bitwise equal to no checkpointing.
"""
from __future__ import annotations

import copy

import pytest
import torch

import tapesac

import models as M
from conftest import default_loss, reference_check
from test_reference import MATMULS, RANDOM_OPS, SCENARIOS, scenario

pytestmark = pytest.mark.usefixtures("one_thread")

GRAPH = {"backend": "emulated_graph"}
# Scenarios whose blocks repeat (one graph serves several calls) and whose replays all run as graphs once warm.
ALL_GRAPHED = {"mlp", "dropout", "random_ops", "hf_llama", "hf_qwen3", "hf_qwen3_attention_dropout", "shared_param"}


def check_graph_counts(stats) -> None:
    """Every replay of a block call is a warm-up, a launch or a fallback, and each fallback says why."""
    for b in stats.blocks:
        assert b.graph_warmups + b.graph_replays + b.graph_fallbacks == b.replays, b
        if b.graph_fallbacks:
            assert b.graph_fallback and b.graph_detail, b


@pytest.mark.parametrize("schedule", ["one_segment", "planned"])
@pytest.mark.parametrize("policy", [pytest.param("full", id="full"), pytest.param(MATMULS, id="save_matmuls")])
@pytest.mark.parametrize("name", SCENARIOS)
def test_graph_replay_matches_no_checkpointing(name: str, policy, schedule: str) -> None:
    """Exact under both schedules. With one segment per block call every replay of ALL_GRAPHED launches the graph.
    Planned schedules follow measured op times, so their segments vary with the machine's load, and a segment's
    launch that would overwrite outputs an earlier launch of the graph handed out, still referenced, replays eagerly
    (outputs_live): seen once in CI on hf_qwen3_attention_dropout (8 segments, 1 such fallback; 9 segments and none
    in every local run). Only that fallback is allowed there."""
    s = scenario(name)
    res = reference_check(s.make_model, s.make_inputs, policy, s.blocks, s.loss_fn, steps=3,
                          block_calls=s.block_calls, sac_kwargs={**GRAPH, "schedule": schedule})
    assert res.sac.backend == "emulated_graph"
    for st in res.all_stats:
        check_graph_counts(st)
    last = res.stats
    if name in ALL_GRAPHED and policy == "full" and schedule == "one_segment":
        assert last.graph_replays == last.replays > 0, (last.graph_replays, last.replays, last.graph_fallback_reasons)
        assert last.graph_fallbacks == 0, last.graph_fallback_reasons
    if name in ALL_GRAPHED and policy == "full" and schedule == "planned":
        assert last.graph_replays > 0 and set(last.graph_fallback_reasons) <= {"outputs_live"}, (
            last.graph_replays, last.replays, last.graph_fallback_reasons)
    if policy == "full" and name in ("dropout", "random_ops", "hf_qwen3_attention_dropout"):
        assert RANDOM_OPS & set(last.ops_replayed_by_name), sorted(last.ops_replayed_by_name)


def test_one_graph_serves_every_identical_block() -> None:
    """Step 1: the first replay warms up, the second captures; from then on every block call launches the graph."""
    s = scenario("hf_qwen3")
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, steps=2,
                          block_calls=s.block_calls, sac_kwargs=GRAPH)
    first, second = res.all_stats
    assert [b.graph_warmups for b in first.blocks] == [0, 0, 1]  # the backward replays the last block first
    assert first.graph_captures == 1 and first.graph_replays == 2
    # Every replay launches the graph (one per block call with one segment; planned schedules launch per segment).
    assert second.graph_captures == 0 and second.graph_replays == second.replays >= 3
    assert res.sac._session.graph_count == 0  # reference_check closed the TapeSAC: close() releases its graphs
    for b in second.blocks:
        # Only the ops the backward needs run: the graph's other nodes are disabled.
        assert b.graph_nodes_enabled > 0 and b.graph_nodes_disabled > 0, b
        # Each layer's parameters and inputs live elsewhere than the graph's static buffers: they are staged.
        assert b.graph_staged_bytes > 0, b


def test_kept_values_are_staged() -> None:
    """A plan that keeps matmul outputs makes the graph read them from static buffers: still exact, fewer nodes."""
    s = scenario("mlp")
    full = reference_check(s.make_model, s.make_inputs, "full", s.blocks, steps=2, block_calls=3,
                           sac_kwargs=GRAPH).stats
    kept = reference_check(s.make_model, s.make_inputs, MATMULS, s.blocks, steps=2, block_calls=3,
                           sac_kwargs=GRAPH).stats
    assert kept.graph_replays == 3 and full.graph_replays == 3
    assert kept.blocks[0].graph_nodes_enabled < full.blocks[0].graph_nodes_enabled
    # Replaying gelu reads only the kept fc1 output [B, T, 2D] fp32: that is all that is staged (no parameters).
    assert kept.blocks[0].graph_staged_bytes == M.B * M.T * 2 * M.D * 4
    assert full.blocks[0].graph_staged_bytes > kept.blocks[0].graph_staged_bytes


def test_strict_contract_checks_graph_outputs_bytewise() -> None:
    s = scenario("hf_llama")
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, steps=2,
                          block_calls=s.block_calls, sac_kwargs={**GRAPH, "contract": "strict"})
    assert res.stats.graph_replays == res.stats.replays >= 3
    assert res.stats.record_counts.get("match", 0) > 0 and set(res.stats.record_counts) == {"match"}


def test_retain_graph_second_backward_relaunches() -> None:
    """Two backwards over one graph (retain_graph): the second round replays again, gradients accumulate exactly."""
    def twice(loss):
        loss.backward(retain_graph=True)
        loss.backward()

    s = scenario("mlp")
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, backward_fn=twice, steps=2, block_calls=3,
                          sac_kwargs=GRAPH)
    assert res.stats.replays == 6 and res.stats.graph_replays == 6


def test_batchnorm_running_stats_are_not_replayed() -> None:
    """BatchNorm writes its running statistics (external state): that op is never in the graph, and what depends
    on it is kept, so the graph holds the rest; running statistics equal a no-checkpoint run's."""
    s = scenario("batchnorm")
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, steps=3, block_calls=2, sac_kwargs=GRAPH)
    assert res.stats.replays > 0
    for st in res.all_stats:
        check_graph_counts(st)


def test_capture_that_would_not_fit_falls_back() -> None:
    """A limit that fits eager replays but not the graph's static memory: no capture, eager replays, same grads."""
    import tapesac

    def run(backend: str, limit):
        torch.manual_seed(0)
        model = M.Stack([M.MLPBlock(hidden=2048) for _ in range(3)])  # 1 MiB of weights per block
        x = torch.randn(M.B, M.T, M.D)
        sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full", backend=backend, memory_limit=limit)
        try:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                with sac.step():
                    default_loss(model, (x,)).backward()
            return sac.last_step, [p.grad for p in model.parameters()]
        finally:
            sac.close()

    eager, want = run("eager", "100GiB")
    tight = eager.memory.peak_bytes + 16 * 1024
    st, got = run("emulated_graph", tight)
    assert st.graph_replays == 0 and st.graph_fallback_reasons == {"memory_limit": 3}, st.graph_fallback_reasons
    assert "static memory" in st.blocks[0].graph_detail
    assert st.memory.peak_bytes <= tight
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # With room for the statics: the first step is measured eagerly (warm-ups), the second captures and launches,
    # and its peak (statics included) stays under the limit.
    roomy = eager.memory.peak_bytes + 4 * 2**20
    st, got = run("emulated_graph", roomy)
    assert st.graph_captures == 1 and st.graph_replays == 3 and st.graph_fallbacks == 0
    assert st.memory.peak_bytes <= roomy
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_graph_static_memory_is_part_of_the_baseline() -> None:
    import tapesac

    torch.manual_seed(0)
    model = M.Stack([M.MLPBlock() for _ in range(3)])
    x = torch.randn(M.B, M.T, M.D)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full", backend="emulated_graph")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with sac.step():
            default_loss(model, (x,)).backward()
    held = sac._session.graph_static_bytes
    assert held > 0 and sac._session.graph_count == 1
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sac.last_step.memory.baseline_bytes == params + held  # step 2 starts without gradients
    sac.close()
    assert sac._session.graph_static_bytes == 0 and sac._session.graph_count == 0  # close() releases the graphs


def _auto_run(limit_of, steps: int = 4):
    """tiny Qwen3 under policy="auto" with the emulated graph backend at limit_of(full_peak, none_peak): per-step
    stats and plans; every step's gradients bitwise equal to a plain run's."""
    import tapesac
    from tapesac.models import tiny_qwen3

    from conftest import assert_same_grads

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 259, (4, 128), generator=g)
    peaks = {}
    for policy in ("none", "full"):
        torch.manual_seed(0)
        m = tiny_qwen3()
        sac = tapesac.TapeSAC(m, policy=policy, backend="eager")
        with sac.step():
            m(input_ids=x, labels=x).loss.backward()
        peaks[policy] = sac.last_step.memory.peak_bytes
        sac.close()
    limit = limit_of(peaks["full"], peaks["none"])
    torch.manual_seed(0)
    model = tiny_qwen3()
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, memory_limit=limit, backend="emulated_graph")
    stats = []
    try:
        for i in range(steps):
            with sac.step():
                model(input_ids=x, labels=x).loss.backward()
            ref(input_ids=x, labels=x).loss.backward()
            assert_same_grads(model, ref, f"step {i}")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            st = sac.last_step
            assert st.memory.peak_bytes <= limit, (i, st.memory.peak_bytes, limit)
            stats.append(st)
        return stats, sac.plan, peaks, sac._session.graph_static_bytes

    finally:
        sac.close()


def test_planner_leaves_room_for_the_graphs() -> None:
    """With room under the limit, the plan reserves the graph's static memory (measured on the first step's
    warm-ups), the graph is captured on the second step and every later replay launches it, under the limit."""
    stats, plan, _, held = _auto_run(lambda full, none: int(full + 0.7 * (none - full)))
    assert [s.graph_captures for s in stats] == [0, 1, 0, 0]
    assert stats[0].graph_replays == 0  # measuring step: the statics' room is not known yet
    assert stats[-1].graph_replays == stats[-1].replays > 0 and stats[-1].graph_fallbacks == 0
    assert plan["graph_reserve_bytes"] == held > 0


def test_no_room_for_the_graphs_replays_eagerly() -> None:
    stats, plan, _, held = _auto_run(lambda full, none: int(full + 0.3 * (none - full)))
    assert plan["graph_reserve_bytes"] == 0 and held == 0
    assert stats[-1].graph_fallback_reasons == {"memory_limit": stats[-1].graph_fallbacks}
    assert stats[-1].graph_fallbacks == stats[-1].replays > 0
    assert "no room" in stats[-1].blocks[0].graph_detail


def test_a_plan_that_keeps_everything_needs_no_graph() -> None:
    stats, plan, peaks, held = _auto_run(lambda full, none: none)
    assert plan["keeps_everything"] and plan["graph_reserve_bytes"] == 0
    assert stats[-1].replays == 0 and held == 0
    assert stats[-1].memory.peak_bytes == peaks["none"]


def test_a_launch_runs_only_the_needed_ops() -> None:
    """After the capture, a launch runs exactly the ops an eager replay runs (the unneeded nodes are disabled): a
    dispatch mode counting the backward's matmuls and GELUs sees the same numbers for both backends."""
    import tapesac
    from test_recompute import OpCounter

    def backward_counts(backend: str):
        torch.manual_seed(0)
        model = M.Stack([M.MLPBlock() for _ in range(3)])
        x = torch.randn(M.B, M.T, M.D)
        sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full", backend=backend)
        try:
            for step in range(2):  # step 1 warms up and captures; step 2 only launches
                with sac.step():
                    loss = default_loss(model, (x,))
                    counter = OpCounter()
                    with counter:
                        loss.backward()
            assert sac.last_step.graph_replays == (3 if backend == "emulated_graph" else 0)
            return {k: v for k, v in counter.counts.items() if k in ("aten::addmm", "aten::gelu")}
        finally:
            sac.close()

    eager, graph = backward_counts("eager"), backward_counts("emulated_graph")
    # fc1 is replayed (gelu saves its output); fc2's output is saved by nothing, so neither backend reruns it.
    assert eager == graph == {"aten::addmm": 3, "aten::gelu": 3}, (eager, graph)


def _timed_run(graph_timing: str, steps: int = 3):
    import tapesac

    torch.manual_seed(0)
    model = M.Stack([M.MLPBlock() for _ in range(3)])
    x = torch.randn(M.B, M.T, M.D)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full", backend="emulated_graph",
                          graph_timing=graph_timing)
    try:
        out = []
        for _ in range(steps):
            with sac.step():
                default_loss(model, (x,)).backward()
            out.append(sac.last_step)
        return out
    finally:
        sac.close()


def test_every_launch_timed_charges_only_the_ops_it_ran() -> None:
    """graph_timing="every": each launch is timed per op; the ops charged are exactly those the launch ran (the
    disabled nodes of fc2's matmul, which nothing reads, cost nothing)."""
    stats = _timed_run("every")
    for st in stats:
        assert st.graph_timed_launches == st.graph_replays > 0
        assert st.graph_device_ms == pytest.approx(sum(b.graph_device_ms for b in st.blocks))
    for b in stats[-1].blocks:
        assert b.graph_timing == "cpu_clock" and b.graph_timing_note == "", b
        assert b.graph_timed_launches == b.graph_replays == 1
        names = [n for _, n, _ in b.graph_op_ms]
        # One launch: one entry per op the launch ran, no more (the disabled ones are absent).
        assert len(b.graph_op_ms) == b.ops_replayed, (b.graph_op_ms, b.ops_replayed)
        assert names.count("aten::addmm") == 1 and names.count("aten::gelu") == 1, names
        assert all(ms > 0 for _, _, ms in b.graph_op_ms)
        assert b.graph_device_ms == pytest.approx(sum(ms for _, _, ms in b.graph_op_ms))
        # fc2's addmm is the block's last recorded addmm: its node is disabled, so it is never charged.
        assert max(i for i, n, _ in b.graph_op_ms if n == "aten::addmm") < b.ops_recorded - 1


def test_first_launch_of_each_graph_is_timed_once() -> None:
    """graph_timing="first" (the default): the three identical blocks share one graph, timed at its first launch
    only (a device synchronisation per graph, not per launch)."""
    stats = _timed_run("first")
    assert sum(st.graph_timed_launches for st in stats) == 1
    assert sum(st.graph_replays for st in stats) > 1
    (timed,) = [b for st in stats for b in st.blocks if b.graph_timed_launches]
    assert timed.graph_device_ms > 0 and timed.graph_timing == "cpu_clock"


def test_graph_timing_off_times_nothing_and_bad_values_are_refused() -> None:
    import tapesac

    stats = _timed_run("off")
    assert all(st.graph_timed_launches == 0 and st.graph_device_ms == 0 for st in stats)
    assert all(b.graph_op_ms == () and b.graph_timing_note == "" for st in stats for b in st.blocks)
    with pytest.raises(tapesac.ConfigError, match=r"graph_timing='sometimes' is not supported; expected one of "
                                                  r"\['first', 'every', 'off'\]"):
        tapesac.TapeSAC(M.Stack([M.MLPBlock()]), blocks="blocks.*", graph_timing="sometimes")


def test_timed_launches_stay_exact() -> None:
    s = scenario("hf_qwen3_attention_dropout")
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, s.loss_fn, steps=3,
                          block_calls=s.block_calls, sac_kwargs={**GRAPH, "graph_timing": "every"})
    assert res.stats.graph_timed_launches == res.stats.graph_replays > 0


def test_bench_reports_the_timed_launches() -> None:
    """The benchmark's JSON carries the timed launches of a tapesac's history (its priming steps, by default)."""
    from tapesac.bench import _graph_launch_times

    got = _graph_launch_times(_timed_run("first"), top=2)
    assert got is not None and got["notes"] == []
    (t,) = got["timed"]
    assert t["source"] == "cpu_clock" and t["launches"] == 1 and t["device_ms"] > 0
    assert len(t["top_ops_ms"]) == 2 and t["top_ops_ms"][0][2] >= t["top_ops_ms"][1][2]
    assert _graph_launch_times(_timed_run("off")) is None


class _NoisyBlock(torch.nn.Module):
    """Dropout, then an in-place random write to a buffer (it must not re-run, so no graph holds it), then dropout
    again: the buffer's draw sits between the graph's two random ops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(M.D, M.D)
        self.register_buffer("noise", torch.zeros(M.D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.nn.functional.dropout(self.fc(x), 0.3)
        self.noise.bernoulli_(0.5)
        c = torch.nn.functional.dropout(self.fc(x), 0.3)
        return x + a * c + self.noise


def test_a_random_op_outside_the_graph_between_its_random_ops_is_refused() -> None:
    """The graph's random offsets would skip the buffer's draw (Note [Graph RNG]); the offset check cannot see it,
    so the key is never captured: every replay stays eager, with the reason, and exact."""
    res = reference_check(lambda: M.Stack([_NoisyBlock() for _ in range(2)]),
                          lambda: (torch.randn(M.B, M.T, M.D, requires_grad=True),), "full", "blocks.*", steps=3,
                          block_calls=2, sac_kwargs=GRAPH)
    for st in res.all_stats:
        check_graph_counts(st)
        assert st.graph_replays == 0
    last = res.stats
    assert last.graph_fallback_reasons == {"rng_mismatch": 2}, last.graph_fallback_reasons
    assert all("cannot be in the graph but draws between" in b.graph_detail for b in last.blocks)


@pytest.mark.parametrize("bound", ["cpu", "cuda"])
def test_a_graph_bound_to_another_device_refuses_host_tensors(bound: str, monkeypatch) -> None:
    """Issue 17 item 7 (Note [Host tensors under capture]): a graph bound to a device type never captures ops that
    read tensors elsewhere (a CUDA graph bakes a CPU scalar's value in at capture). The emulation bound to "cuda"
    sees this CPU model's every input as a host tensor: each replay falls back to eager with reason host_tensors,
    and the gradients stay bitwise equal to no checkpointing; bound to "cpu" it launches graphs as usual."""
    import tapesac

    orig = tapesac._C.emulated_graph_device
    monkeypatch.setattr(tapesac._C, "emulated_graph_device", lambda: orig(bound))
    s = scenario("mlp")
    res = reference_check(s.make_model, s.make_inputs, "full", s.blocks, steps=3, block_calls=3, sac_kwargs=GRAPH)
    last = res.stats
    if bound == "cpu":
        assert last.graph_replays == last.replays > 0 and last.graph_fallbacks == 0, last.graph_fallback_reasons
    else:
        assert last.graph_replays == 0 and last.graph_fallbacks == last.replays > 0
        assert set(last.graph_fallback_reasons) == {"host_tensors"}, last.graph_fallback_reasons
        details = {b.graph_detail for b in last.blocks}
        assert all("tensor on cpu" in d and "cuda graph would bake" in d for d in details), details


class _PenaltyBlock(torch.nn.Module):
    """An independent fuzzer's block: an in-place write on a copy, then a two-output foreach op."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(8) * 0.1)
        self.g = torch.nn.Parameter(1 + torch.randn(8) * 0.1)

    def forward(self, x):
        c = x.clamp(-0.5, 0.7)
        y = torch.nn.functional.group_norm(c, 2, self.g, self.b)
        t = y.clone()
        t.addcmul_(c, c, value=0.1)
        a, b = torch._foreach_mul([y, t], 2.0)
        return a + b


class _PenaltyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_PenaltyBlock()])
        self.target = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)

    def forward(self, x):
        h = self.layers[0](self.layers[0](x))  # one graph serves both calls
        return (h * self.target).sum() + (h * h).mean()


def _penalty_steps(model, sac=None, steps: int = 3):
    """Gradient-penalty steps (create_graph: the second backward reads what the first one unpacked), SGD between."""
    grads = []
    for s in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(77 + s))
        torch.manual_seed(1000 + s)
        with sac.step() if sac is not None else torch.enable_grad():
            loss = model(x)
            params = [p for p in model.parameters() if p.requires_grad]
            gs = torch.autograd.grad(loss, params, create_graph=True)
            (loss + 0.1 * sum((g * g).sum() for g in gs)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in params:
                p -= 0.05 * p.grad
                p.grad = None
    return grads


@pytest.mark.parametrize("schedule", ["one_segment", "planned", "hold_all", "lazy"])
def test_a_launch_never_writes_over_a_replayed_tensor_still_in_use(schedule: str) -> None:
    """Note [Handed-out storages] (replay/src/graph_block.cpp). A double backward keeps what the first backward
    unpacked (replayed tensors, over the graph's static memory) for the second; with one graph serving two calls of
    a block, a launch for one call must not write over what another call's launch handed out while it is in use —
    neither by its ops nor by staging that call's kept values into the static buffers. Both happened (an
    independent fuzzer: schedule hold_all, step 2's bias gradient off by 5e5; random program 3025), silently: the
    strict contract checks the bytes when they are replayed, not when autograd reads them later."""
    torch.manual_seed(507)
    base = _PenaltyModel()
    want = _penalty_steps(copy.deepcopy(base))
    model = copy.deepcopy(base)
    sac = tapesac.TapeSAC(model, blocks="layers.*", policy="full", schedule=schedule, contract="strict", **GRAPH)
    got = _penalty_steps(model, sac)
    for s, (g, w) in enumerate(zip(got, want)):
        for name in w:
            assert torch.equal(g[name], w[name]), (s, name, (g[name] - w[name]).abs().max().item())
    launched = sum(st.graph_replays for st in sac.history)
    assert launched > 0  # the graph ran: the case is not an eager replay
    sac.close()


class _ConjBlock(torch.nn.Module):
    def __init__(self, neg: bool) -> None:
        super().__init__()
        self.neg = neg
        self.w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat) / 4)

    def forward(self, x):
        h = x @ self.w
        if self.neg:  # .imag of a conj() view: a real tensor with the neg bit
            return torch.view_as_complex(torch.stack([h.real * h.conj().imag, h.imag], -1))
        return h.conj() * h  # mul saves h.conj(): a conj-bit view of h


@pytest.mark.parametrize("neg", [False, True], ids=["conj", "neg"])
@pytest.mark.parametrize("schedule", ["one_segment", "lazy"])
def test_a_launch_hands_out_conj_and_neg_views_with_their_bits(neg: bool, schedule: str) -> None:
    """Found by an adversarial test on Note [Handed-out storages]: the tensors a launch hands out were made over the
    static bytes without the conj and neg bits of the recorded view, so a saved `h.conj()` read as `h` (the bytes
    are the same: contract="strict" saw nothing) and gradients were silently wrong from the first launch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_ConjBlock(neg))
    ref = copy.deepcopy(model)
    sac = tapesac.TapeSAC(model, blocks="0", policy="full", schedule=schedule, contract="strict", **GRAPH)
    for _ in range(3):
        x = torch.randn(4, 8, dtype=torch.cfloat)
        with sac.step():
            model(x).abs().sum().backward()
        ref(x).abs().sum().backward()
        assert torch.equal(model[0].w.grad, ref[0].w.grad)
    assert sac.last_step.graph_replays > 0
    sac.close()


class _SparseBlock(torch.nn.Module):
    def __init__(self, made_inside: bool) -> None:
        super().__init__()
        self.made_inside = made_inside
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, adj):
        if self.made_inside:  # a sparse tensor the block makes (and autograd saves)
            adj = (adj.to_dense() * 2).to_sparse()
        return x + torch.tanh(torch.sparse.mm(adj, self.fc(x)))


class _SparseNet(torch.nn.Module):
    def __init__(self, made_inside: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_SparseBlock(made_inside) for _ in range(2)])

    def forward(self, x, adj):
        for b in self.blocks:
            x = b(x, adj)
        return x


def _adjacency(layout: str) -> torch.Tensor:
    a = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]]), torch.ones(4), (4, 4)).coalesce()
    return a.to_sparse_csr() if layout == "csr" else a


@pytest.mark.parametrize("layout,made_inside", [("coo", False), ("csr", False), ("coo", True)])
def test_a_block_reading_a_sparse_tensor_replays_eagerly_under_the_graph_backend(layout: str,
                                                                                 made_inside: bool) -> None:
    """A helper's finding: a sparse block input (COO or CSR), or a sparse tensor the block made, crashed the graph
    backend's capture with torch's untyped RuntimeError in the backward, every step (the capture's static buffers are
    strided). Such a key is refused (host_tensor_read: a value without strides) and replays eagerly, exact."""
    import warnings

    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    adj = _adjacency(layout)
    reference_check(lambda: _SparseNet(made_inside), lambda: (torch.randn(4, 8), adj), "full",
                    lambda m: list(m.blocks), steps=3, sac_kwargs={"backend": "emulated_graph"}, expect_replay=True)
