"""Composition with PyTorch's distributed engines on CPU: DDP and FSDP2 (fully_shard), gloo, 2 processes.

Each rank trains the same model (4 blocks: MLP, attention, dropout, MLP) twice, under the same engine: once
without tapesac and once with a TapeSAC on the blocks, 3 SGD steps on rank-specific data (dist_worker.py). The
test process compares, per rank and step, the local loss and every gradient *after* the engine's collective
(DDP: the all-reduced gradient; FSDP2: the rank's shard of the reduce-scattered gradient) bitwise: the local
gradients are bitwise equal (tapesac is exact on CPU), and gloo's all-reduce / reduce-scatter of bitwise-equal
inputs in the same order give bitwise-equal results, so no tolerance is needed.

Each test runs its 2 processes with a deadline (kills them if they hang) and a file-based rendezvous in a fresh
temporary directory (no port to pick, nothing left behind).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import assert_same_tensor

HERE = Path(__file__).resolve().parent
WORLD = 2
DEADLINE_S = 50


def _launch(tmp_path: Path, engine: str, policy: str) -> list[dict]:
    import dist_worker

    init_file = tmp_path / "rendezvous"
    results = tmp_path / "results"
    results.mkdir()
    ctx = mp.start_processes(dist_worker.run, args=(WORLD, str(init_file), engine, policy, str(results)),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"{engine}: the {WORLD} ranks did not finish within {DEADLINE_S} s (hang in a "
                                     f"collective?); errors so far: {_errors(results)}")
    except mp.ProcessRaisedException as e:
        raise AssertionError(f"{engine} with tapesac policy {policy!r}: a rank raised:\n{_errors(results) or e}") from None
    except mp.ProcessExitedException as e:
        raise AssertionError(f"{engine}: a rank exited abnormally ({e}); errors: {_errors(results)}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [torch.load(results / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _errors(results: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(results.glob("*.err")))


@pytest.fixture(autouse=True)
def _worker_path(monkeypatch):
    """Spawned ranks import dist_worker and models from this directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))


requires_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                   reason="torch.distributed with gloo is not available in this build")


def _compare(per_rank: list[dict], engine: str, policy: str) -> None:
    for rank, res in enumerate(per_rank):
        ref_losses, ref_grads, _ = res["ref"]
        losses, grads, stats = res["got"]
        assert len(losses) == len(ref_losses) > 0
        for step in range(len(ref_losses)):
            what = f"{engine}, policy {policy}, rank {rank}, step {step + 1}"
            assert_same_tensor(f"{what}: loss", losses[step], ref_losses[step])
            assert grads[step].keys() == ref_grads[step].keys(), (sorted(grads[step]), sorted(ref_grads[step]))
            defined = 0
            for name, g in ref_grads[step].items():
                assert_same_tensor(f"{what}: grad of {name}", grads[step][name], g)
                defined += g is not None
            assert defined > 0, f"{what}: no gradient at all"
            st = stats[step]
            assert st["ops_recorded"] > 0 and st["block_calls"] == 4, f"{what}: tapesac did not record: {st}"
            if policy == "full":
                assert st["dropped_tensors"] > 0 and st["ops_replayed"] > 0, f"{what}: nothing dropped/replayed: {st}"
    # The ranks saw different data: the gradients before the collective differed, so the collective mattered.
    l0, l1 = per_rank[0]["ref"][0][0], per_rank[1]["ref"][0][0]
    assert not torch.equal(l0, l1), "both ranks computed the same loss: the data is not rank-specific"


@requires_gloo
@pytest.mark.parametrize("policy", ["full", "none"])
def test_ddp(tmp_path: Path, policy: str) -> None:
    per_rank = _launch(tmp_path, "ddp", policy)
    _compare(per_rank, "ddp", policy)
    # DDP all-reduces: both ranks hold the same full gradient.
    for step in range(len(per_rank[0]["got"][1])):
        for name, g in per_rank[0]["got"][1][step].items():
            assert_same_tensor(f"ddp step {step + 1}: rank 0 vs rank 1 grad of {name}", g, per_rank[1]["got"][1][step][name])


@requires_gloo
@pytest.mark.parametrize("policy", ["full", "none"])
def test_fsdp2(tmp_path: Path, policy: str) -> None:
    per_rank = _launch(tmp_path, "fsdp2", policy)
    _compare(per_rank, "fsdp2", policy)
    # FSDP2 really sharded: each rank holds dim-0 shards that together make the full gradient.
    import dist_worker

    full = dict(dist_worker._model().named_parameters())
    grads = [per_rank[r]["got"][1][0] for r in range(WORLD)]
    for name, p in full.items():
        shards = [grads[r][name] for r in range(WORLD)]
        assert sum(s.shape[0] for s in shards) == p.shape[0] and all(s.shape[0] < p.shape[0] for s in shards), (
            f"{name}: local gradient shapes {[tuple(s.shape) for s in shards]} are not shards of {tuple(p.shape)}")
