"""The `backend=` argument: validation and the backend each value resolves to.

On CPU, "auto" and "eager" resolve to eager replay (exact), "cuda_graph" raises ConfigError saying it needs a CUDA
device, and "emulated_graph" is accepted on any device. On a CUDA device with the GPU backend built, "auto" resolves
to "cuda_graph"; those cases are marked gpu (test_graph_gpu.py runs the graph replays themselves).
"""
from __future__ import annotations

import pytest
import torch

from conftest import reference_check
from models import stack, x_in

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_auto_and_eager_resolve_to_eager_on_cpu(tapesac, backend) -> None:
    sac = tapesac.TapeSAC(stack(), blocks="blocks.*", policy="full", backend=backend)
    assert sac.backend == "eager"


def test_cuda_graph_on_cpu_needs_a_cuda_device(tapesac) -> None:
    with pytest.raises(tapesac.ConfigError) as ei:
        tapesac.TapeSAC(stack(), blocks="blocks.*", policy="full", backend="cuda_graph")
    msg = str(ei.value)
    assert "needs a CUDA device" in msg and "cpu" in msg, msg  # expected, found
    assert "backend='eager'" in msg, msg  # how to fix


def test_unknown_backend_lists_every_accepted_value(tapesac) -> None:
    with pytest.raises(tapesac.ConfigError) as ei:
        tapesac.TapeSAC(stack(), blocks="blocks.*", policy="full", backend="graph")
    for accepted in ("auto", "eager", "cuda_graph", "emulated_graph"):
        assert accepted in str(ei.value)


def test_auto_backend_step_is_exact_on_cpu() -> None:
    reference_check(stack, lambda: (x_in(),), "full", "blocks.*", sac_kwargs={"backend": "auto"})


@pytest.mark.gpu
def test_auto_picks_cuda_graph_on_cuda(tapesac) -> None:
    model = stack().cuda()
    assert tapesac.TapeSAC(model, blocks="blocks.*", policy="full", backend="cuda_graph").backend == "cuda_graph"
    want = "cuda_graph" if tapesac._C.has_cuda_backend else "eager"
    assert tapesac.TapeSAC(model, blocks="blocks.*", policy="full", backend="auto").backend == want


def test_emulated_graph_is_accepted_on_cpu(tapesac) -> None:
    assert tapesac.TapeSAC(stack(), blocks="blocks.*", policy="full", backend="emulated_graph").backend == \
        "emulated_graph"


@pytest.mark.gpu
def test_auto_backend_step_is_exact_on_cuda() -> None:
    reference_check(stack, lambda: (x_in(),), "full", "blocks.*", device="cuda", sac_kwargs={"backend": "auto"})
