"""Per-op device times for the planner's cost model (issue 6, CUPTI timing).

On CUDA with policy="auto", every block call's tape is timed on the device (CUPTI, else CUDA events) and the
planner's op costs are those figures; elsewhere the recorder's CPU clock stays and nothing synchronises. What is
checked: the source each block reports (BlockStats.op_timing / StepStats.op_timing) on CPU and CUDA, the reason
given when device timing is asked for without a device, that torch.profiler keeps CUPTI (events instead), and that
the planner's costs of the matmuls are positive device times.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _qwen(device: str):
    from tapesac.models import tiny_qwen3

    torch.manual_seed(0)
    return tiny_qwen3().to(device)


def _tokens(device: str, batch: int = 2, seq: int = 64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 259, (batch, seq), generator=g).to(device)


def _step(sac, model, x) -> None:
    with sac.step():
        model(input_ids=x, labels=x).loss.backward()


def _problem_ops(dump: str) -> list[tuple[str, float]]:
    """(op name, cost_ns) per op of a planner problem dump (planner/problem_io.h format)."""
    lines = [ln for ln in dump.splitlines() if ln.strip() and not ln.startswith("#")]
    at = next(i for i, ln in enumerate(lines) if ln.startswith("ops "))
    n = int(lines[at].split()[1])
    out = []
    for ln in lines[at + 1 : at + 1 + n]:
        fields = ln.split()
        out.append((fields[2], float(fields[0])))
    return out


def test_cpu_steps_use_the_cpu_clock(tapesac) -> None:
    model = _qwen("cpu")
    x = _tokens("cpu")
    sac = tapesac.TapeSAC(model, memory_limit="90%")
    _step(sac, model, x)
    st = sac.last_step
    assert st.block_calls > 0
    assert st.op_timing == "cpu_clock"
    assert all(b.op_timing == "cpu_clock" and b.op_timing_note == "" for b in st.blocks)
    sac.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device path")
def test_device_timing_without_a_device_says_why(tapesac) -> None:
    s = tapesac._C.Session("none", device_timing=True)
    x = torch.randn(32, 32)
    s.begin_step([])
    assert s.begin_block("b")
    torch.mm(x, x)
    s.end_block()
    s.end_step()
    (b,) = s.last_stats()
    assert b["op_timing"] == "cpu_clock"
    assert "no CUDA device" in b["op_timing_note"] or "without the GPU backend" in b["op_timing_note"]
    s.shutdown()


@pytest.mark.gpu
def test_cuda_auto_step_times_ops_on_the_device(tapesac) -> None:
    model = _qwen("cuda")
    x = _tokens("cuda", batch=4, seq=256)
    sac = tapesac.TapeSAC(model, memory_limit="90%")
    _step(sac, model, x)
    st = sac.last_step
    assert st.block_calls > 0
    for b in st.blocks:
        assert b.op_timing in ("cupti", "cuda_events"), (b.op_timing, b.op_timing_note)
        if b.op_timing == "cuda_events":
            assert b.op_timing_note, "the events fallback must say why CUPTI was not used"
    # What the planner reads: its problem of each call carries the device times; matmuls cost device time.
    matmuls = 0
    for i in range(sac._planner.observed_calls):
        for name, cost in _problem_ops(sac._planner.dump_problem(i)):
            if name in ("aten::mm", "aten::addmm", "aten::bmm"):
                matmuls += 1
                assert cost > 0, (i, name, cost)
    assert matmuls > 0
    sac.close()


@pytest.mark.gpu
def test_cuda_static_policy_keeps_the_cpu_clock(tapesac) -> None:
    model = _qwen("cuda")
    sac = tapesac.TapeSAC(model, policy="full")
    _step(sac, model, _tokens("cuda"))
    assert sac.last_step.op_timing == "cpu_clock"
    sac.close()


@pytest.mark.gpu
@pytest.mark.profiler  # last in the session: after it tapesac can never claim CUPTI in this process (conftest)
def test_cuda_profiler_keeps_cupti(tapesac) -> None:
    model = _qwen("cuda")
    sac = tapesac.TapeSAC(model, memory_limit="90%")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        _step(sac, model, _tokens("cuda"))
    assert sac.last_step.op_timing == "cuda_events"
    assert all("torch.profiler" in b.op_timing_note for b in sac.last_step.blocks)
    # The profiler's own trace still has the step's kernels.
    assert any(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    sac.close()


def test_profiler_tests_run_after_every_other_test() -> None:
    """Issue 17 item 5: once torch.profiler ran, kineto stays subscribed to CUPTI for the rest of the process, so
    the tests marked `profiler` are collected last (conftest.profiler_last), each group in its own order."""
    from conftest import profiler_last

    class Item:
        def __init__(self, name: str, profiler: bool) -> None:
            self.name, self.profiler = name, profiler

        def get_closest_marker(self, marker: str):
            return object() if marker == "profiler" and self.profiler else None

    items = [Item("cupti_a", False), Item("prof_1", True), Item("cupti_b", False), Item("prof_2", True)]
    profiler_last(items)
    assert [i.name for i in items] == ["cupti_a", "cupti_b", "prof_1", "prof_2"]
