"""GPU tests of the CUDA-graph replay backend (``TapeSAC(backend="cuda_graph")``).

What they pin down, on small HF Qwen3 / Llama decoders (tapesac.models builders, random weights, offline) under
``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (conftest sets both):
- three steps with the graph backend give loss and every gradient bitwise equal to a no-checkpoint run and to
  ``backend="eager"``; the first replay of a block signature runs eagerly, the second captures, so from step 3 on
  every block's replay is a graph launch (``BlockStats.graph_replays``), with no fallback;
- dropout (attention dropout, nn.Dropout, rand_like) replays the forward's masks through the graph;
- under ``memory_limit`` the measured step peak (``torch.cuda.max_memory_allocated``) stays within it;
- ``backend="auto"`` resolves to ``"cuda_graph"`` on a CUDA model;
- ``graph_timing="every"``: every launch is timed per op by CUPTI, and under torch.profiler launches run untimed
  with the reason.
Every test is marked gpu: conftest skips them where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import models as M
from conftest import assert_same_grads, assert_same_tensor, default_loss, reference_check

LAYERS = 3
BLOCKS = "model.layers.*"
GRAPH_FIELDS = ("graph_replays", "graph_captures", "graph_fallbacks", "graph_fallback", "graph_staged_bytes",
                "graph_nodes_enabled", "graph_nodes_disabled")


def _hf(arch: str, **overrides: Any) -> Callable[[], nn.Module]:
    """A builder of a small decoder of `arch` ("qwen3" or "llama") with LAYERS layers, seeded."""

    def make() -> nn.Module:
        from tapesac import models

        fn = {"qwen3": models.tiny_qwen3, "llama": models.tiny_llama}[arch]
        return fn(hidden_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, seed=0, **overrides)

    return make


def _ids(batch: int = 2, seq: int = 64) -> Callable[[], torch.Tensor]:
    from tapesac.models import BYTE_VOCAB_SIZE

    return lambda: torch.randint(0, BYTE_VOCAB_SIZE, (batch, seq), device="cuda")


def graph_stats(stats: Any) -> dict[str, Any]:
    """The graph counters of one step, summed over its block calls (``graph_fallback``: the non-empty reasons)."""
    missing = [f for f in GRAPH_FIELDS for b in stats.blocks[:1] if not hasattr(b, f)]
    assert not missing, f"BlockStats has no {missing}: the CUDA-graph statistics are not reported"
    out: dict[str, Any] = {f: sum(getattr(b, f) for b in stats.blocks) for f in GRAPH_FIELDS if f != "graph_fallback"}
    out["graph_fallback"] = sorted({b.graph_fallback for b in stats.blocks if b.graph_fallback})
    out["blocks_without_graph"] = [b.name for b in stats.blocks if b.replays and not b.graph_replays]
    return out


def assert_graph_replayed_from_step_3(res: Any) -> None:
    """Step 1 replays eagerly (warm-up), step 2 captures, steps >= 3 launch graphs for every replayed block."""
    per_step = [graph_stats(s) for s in res.all_stats]
    assert sum(g["graph_captures"] for g in per_step) > 0, f"no block was ever captured: {per_step}"
    for step, g in enumerate(per_step[2:], start=3):
        assert g["graph_replays"] > 0, f"step {step} launched no graph: {g}"
        assert not g["blocks_without_graph"], f"step {step}: blocks replayed eagerly: {g}"
        assert g["graph_fallbacks"] == 0 and not g["graph_fallback"], f"step {step} fell back to eager: {g}"
        assert g["graph_nodes_enabled"] > 0, f"step {step}: graphs launched with no node enabled: {g}"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cuda_graph_is_bitwise_equal_to_no_checkpointing_and_to_eager(arch: str) -> None:
    make, ids = _hf(arch), _ids()
    graph = reference_check(make, ids, "full", BLOCKS, M.hf_loss, steps=3, device="cuda", block_calls=LAYERS,
                            sac_kwargs={"backend": "cuda_graph"})
    assert graph.sac.backend == "cuda_graph"
    assert_graph_replayed_from_step_3(graph)

    eager = reference_check(make, ids, "full", BLOCKS, M.hf_loss, steps=3, device="cuda", block_calls=LAYERS,
                            sac_kwargs={"backend": "eager"})
    assert eager.sac.backend == "eager"
    assert all(graph_stats(s)["graph_replays"] == 0 for s in eager.all_stats), "backend='eager' launched graphs"
    assert_same_tensor("cuda_graph vs eager: loss", graph.loss.detach(), eager.loss.detach())
    assert assert_same_grads(graph.model, eager.model, "cuda_graph vs eager (3 steps accumulated): ") > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen3_attention_dropout", "hidden_dropout"])
def test_cuda_graph_replays_the_forwards_dropout_masks(model: str) -> None:
    if model == "qwen3_attention_dropout":
        make, inputs, blocks, calls, loss = _hf("qwen3", attention_dropout=0.2), _ids(), BLOCKS, LAYERS, M.hf_loss
    else:
        # nn.Dropout, F.dropout and a rand_like mask (DropoutBlock), and SDPA's own dropout (AttentionBlock).
        def make() -> nn.Module:
            return M.Stack([M.DropoutBlock(), M.AttentionBlock(dropout=0.2), M.DropoutBlock()])

        def inputs() -> tuple[torch.Tensor]:
            return (torch.randn(M.B, M.T, M.D, device="cuda", requires_grad=True),)

        blocks, calls, loss = "blocks.*", 3, default_loss
    # fp32 attention with dropout runs the memory-efficient kernel, whose Philox seed and offset are CPU tensors
    # eagerly and CUDA tensors under capture: the launch hands them out as CPU copies (issue 17 item 3), else the
    # backward would dereference device pointers on the host.
    # reference_check seeds both runs identically, so equal gradients mean equal masks; it also checks that the
    # CUDA RNG state after the step is the reference's (the graph launch must put the generator back).
    res = reference_check(make, inputs, "full", blocks, loss, steps=3, device="cuda", block_calls=calls,
                          sac_kwargs={"backend": "cuda_graph"})
    assert_graph_replayed_from_step_3(res)


@pytest.mark.gpu
def test_cuda_graph_step_peak_stays_within_memory_limit(tapesac: Any) -> None:
    torch.manual_seed(0)
    model = _hf("qwen3")().cuda().train()
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (4, 256), device="cuda")

    def step() -> torch.Tensor:
        torch.manual_seed(2)
        loss = M.hf_loss(model, ids)
        loss.backward()
        return loss.detach()

    def above_entry(fn: Callable[[], Any]) -> int:
        """Peak bytes above the allocation level at entry of one call (gradients None at entry)."""
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        entry = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - entry)

    none_peak = above_entry(step)
    model.zero_grad(set_to_none=True)
    ref_loss = step()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    full = tapesac.TapeSAC(model, blocks=BLOCKS, policy="full", backend="eager")

    def full_step() -> None:
        with full.step():
            step()

    full_peak = above_entry(full_step)
    full.close()
    assert full_peak < none_peak, f"full checkpointing peak {full_peak} B not below no checkpointing's {none_peak} B"
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    # Three quarters of the way to the no-checkpoint peak: room for the planner's plan and the one graph the
    # identical layers share (its static memory is about one layer's activations and parameters; at 30% of the
    # way the CPU run of perf/graph_limit_cpu.py had no room and replayed eagerly, at 70% it launched every replay).
    limit = torch.cuda.memory_allocated() + full_peak + (none_peak - full_peak) * 3 // 4

    sac = tapesac.TapeSAC(model, blocks=BLOCKS, policy="auto", backend="cuda_graph", memory_limit=limit)
    assert sac.backend == "cuda_graph"
    graph_replays = 0
    try:
        for i in range(1, 5):
            model.zero_grad(set_to_none=True)
            with sac.step():
                loss = step()
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated()  # sac.step() reset the peak at its entry
            st = sac.last_step
            g = graph_stats(st)
            assert measured <= limit, (f"step {i}: measured peak {measured} B over memory_limit {limit} B "
                                       f"(over by {measured - limit} B); graph stats {g}")
            assert st.memory.peak_bytes <= limit, f"step {i}: reported peak {st.memory.peak_bytes} B > {limit} B"
            assert_same_tensor(f"step {i}: loss", loss, ref_loss)
            for n, p in model.named_parameters():
                assert_same_tensor(f"step {i}: grad of {n}", p.grad, ref_grads[n])
            if i >= 3:
                graph_replays += g["graph_replays"]
    finally:
        sac.close()
    assert graph_replays > 0, "steps 3-4 launched no graph under the limit: the limit test did not test the backend"


@pytest.mark.gpu
def test_auto_backend_is_cuda_graph_on_cuda(tapesac: Any) -> None:
    model = _hf("llama")().cuda()
    sac = tapesac.TapeSAC(model, blocks=BLOCKS, policy="full", backend="auto")
    try:
        assert sac.backend == "cuda_graph", f"backend='auto' on CUDA resolved to {sac.backend!r}"
    finally:
        sac.close()


@pytest.mark.gpu
def test_cuda_graph_device_binding(tapesac: Any) -> None:
    from tapesac import _C

    assert _C.has_cuda_backend, "this build has no GPU backend on a machine with CUDA"
    dev = _C.cuda_graph_device(torch.cuda.current_device(), (0, 0))
    assert type(dev).__name__ == "GraphDevice"
    with pytest.raises(tapesac.ConfigError, match="expected a CUDA device index"):
        _C.cuda_graph_device(torch.cuda.device_count(), (0, 0))
    with pytest.raises(tapesac.ConfigError, match="exactly one non-zero half"):
        _C.cuda_graph_device(0, (1, 2))


@pytest.mark.gpu
@pytest.mark.profiler  # its last step runs torch.profiler: last in the session (conftest)
def test_cuda_graph_launches_are_timed_per_op_by_cupti(tapesac: Any) -> None:
    """graph_timing="every": from step 3 every launch is timed by CUPTI, the matmuls are charged device time, and
    the gradients stay equal to no checkpointing (reference_check). Under torch.profiler, which holds CUPTI, the
    launches run untimed and say why."""
    res = reference_check(_hf("qwen3"), _ids(), "full", BLOCKS, M.hf_loss, steps=3, device="cuda",
                          block_calls=LAYERS, sac_kwargs={"backend": "cuda_graph", "graph_timing": "every"})
    assert_graph_replayed_from_step_3(res)
    last = res.stats
    for b in last.blocks:
        assert b.graph_timed_launches == b.graph_replays > 0, (b.name, b.graph_timing_note)
        assert b.graph_timing == "cupti", (b.name, b.graph_timing, b.graph_timing_note)
        names = {n for _, n, _ in b.graph_op_ms}
        assert names & {"aten::mm", "aten::addmm", "aten::bmm"}, sorted(names)
        assert b.graph_device_ms > 0 and b.graph_device_ms == pytest.approx(sum(ms for *_, ms in b.graph_op_ms))

    model, ids = _hf("qwen3")().cuda(), _ids()()
    sac = tapesac.TapeSAC(model, blocks=BLOCKS, policy="full", backend="cuda_graph", graph_timing="every")
    try:
        for _ in range(2):  # warm-up and capture outside the profiler
            with sac.step():
                M.hf_loss(model, ids).backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            with sac.step():
                M.hf_loss(model, ids).backward()
        st = sac.last_step
        assert st.graph_replays > 0 and st.graph_timed_launches == 0
        assert all("CUPTI" in b.graph_timing_note for b in st.blocks if b.graph_replays), \
            [b.graph_timing_note for b in st.blocks]
    finally:
        sac.close()


class _SyncBlock(nn.Module):
    """A linear layer and a torch.nonzero on its output: nonzero synchronises with the host, which invalidates a
    CUDA-graph capture of the block."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(M.D, M.D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        return h * (torch.nonzero(h).shape[0] >= 0)


@pytest.mark.gpu
def test_a_failed_capture_leaves_the_process_usable(tapesac: Any) -> None:
    """Issue 17 item 2: every capture of the block fails (capture_invalidated) and its replays fall back to eager,
    exactly; the arena routing of those eager replays and later eager dropouts and captures still work."""
    def make() -> nn.Module:
        return M.Stack([_SyncBlock(), M.DropoutBlock()])

    def inputs() -> tuple[torch.Tensor]:
        return (torch.randn(M.B, M.T, M.D, device="cuda", requires_grad=True),)

    res = reference_check(make, inputs, "full", "blocks.*", default_loss, steps=3, device="cuda", block_calls=2,
                          sac_kwargs={"backend": "cuda_graph"})
    reasons = set().union(*(set(s.graph_fallback_reasons) for s in res.all_stats))
    assert "capture_invalidated" in reasons, reasons
    d = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5, training=True)
    assert 0 < int((d > 0).sum()) < 4096
    g = torch.cuda.CUDAGraph()
    x = torch.ones(16, device="cuda")
    with torch.cuda.graph(g):
        y = x * 2
    g.replay()
    assert torch.equal(y, torch.full_like(x, 2.0))


class _CpuScalarBlock(nn.Module):
    """A linear layer scaled by a 0-dim CPU tensor (CUDA ops accept CPU scalars; a graph would bake its value)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(M.D, M.D)
        self.scale = torch.tensor(1.5)  # stays on the CPU: not a parameter or buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


@pytest.mark.gpu
def test_a_block_reading_a_cpu_scalar_is_not_captured(tapesac: Any) -> None:
    """Issue 17 item 7: a captured op reading a CPU scalar tensor would replay its capture-time value; such a block
    replays eagerly with reason host_tensors, exactly."""
    def make() -> nn.Module:
        return M.Stack([_CpuScalarBlock(), _CpuScalarBlock()])

    def inputs() -> tuple[torch.Tensor]:
        return (torch.randn(M.B, M.T, M.D, device="cuda", requires_grad=True),)

    res = reference_check(make, inputs, "full", "blocks.*", default_loss, steps=3, device="cuda", block_calls=2,
                          sac_kwargs={"backend": "cuda_graph"})
    last = res.stats
    assert last.graph_replays == 0 and set(last.graph_fallback_reasons) == {"host_tensors"}, last
