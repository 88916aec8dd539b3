"""GPU memory figures and the replay arena (issue 3): run on a machine with a CUDA device; skipped elsewhere.

What they check: the step peak comes from the caching allocator's statistics; every replay allocates from the
instance's private pool (the arena), whose reserved size is close to the largest replay working set (one pool
shared by all blocks), not the sum over blocks; a forced impossible limit raises MemoryLimitError and the next step
is exact; MemoryMeter on the device agrees with torch's own max_memory_allocated.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_same_grads

pytestmark = pytest.mark.gpu


def _qwen_cuda():
    from tapesac.models import tiny_qwen3

    torch.manual_seed(0)
    return tiny_qwen3().cuda()


def _tokens(batch=4, seq=256):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 259, (batch, seq), generator=g).cuda()


def _step(sac, model, x):
    with sac.step():
        model(input_ids=x, labels=x).loss.backward()


def test_cuda_step_peak_is_the_caching_allocators(tapesac) -> None:
    model = _qwen_cuda()
    x = _tokens()
    sac = tapesac.TapeSAC(model, policy="full")
    _step(sac, model, x)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(sac, model, x)
    torch.cuda.synchronize()
    mem = sac.last_step.memory
    assert mem.device.startswith("cuda")
    assert mem.peak_bytes == torch.cuda.max_memory_allocated()
    dm = tapesac._C.device_memory(0)
    assert dm["allocated_peak"] == torch.cuda.max_memory_allocated()
    sac.close()


def test_replays_share_one_arena(tapesac) -> None:
    model = _qwen_cuda()
    x = _tokens()
    sac = tapesac.TapeSAC(model, policy="full")
    for _ in range(2):
        _step(sac, model, x)
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    pool = sac._arena_pool
    reserved = sum(seg["total_size"] for seg in pool.snapshot())
    blocks = sac.last_step.blocks
    largest = max(b.predicted_replay_bytes for b in blocks)
    total = sum(b.predicted_replay_bytes for b in blocks)
    assert largest > 0 and total > largest
    # One shared pool: about one working set (caching-allocator rounding), far below one pool per block.
    assert largest <= reserved < total, (reserved, largest, total)
    sac.close()


def test_cuda_impossible_limit_then_exact_step(tapesac) -> None:
    model = _qwen_cuda()
    ref = copy.deepcopy(model)
    x = _tokens()
    torch.cuda.synchronize()
    sac = tapesac.TapeSAC(model, policy="full", memory_limit=torch.cuda.memory_allocated() + 1024)
    with pytest.raises(tapesac.MemoryLimitError) as ei:
        _step(sac, model, x)
    assert "bytes" in str(ei.value) and "model.layers." in str(ei.value)
    model.zero_grad(set_to_none=True)
    sac.memory_limit = None
    _step(sac, model, x)
    ref(input_ids=x, labels=x).loss.backward()
    assert_same_grads(model, ref)
    sac.close()


def test_memory_meter_on_cuda(tapesac) -> None:
    with tapesac.MemoryMeter("cuda") as m:
        a = torch.empty(1 << 20, device="cuda")
        del a
    assert m.peak_bytes >= 4 << 20
    assert m.current_bytes == 0
