"""The per-rank worker of test_distributed.py: one process of a 2-process gloo group on CPU.

Contract: `run(rank, world, init_file, engine, policy, result_dir)` builds the same model on every rank (same seed),
wraps one copy with the engine ("ddp" or "fsdp2") without tapesac and one copy with the engine and TapeSAC, trains
both for STEPS steps (SGD) on rank-specific data, and writes per step the local loss and, per parameter, the
gradient as the engine leaves it after its collective (DDP: the all-reduced full gradient; FSDP2: this rank's
shard of the reduce-scattered gradient, `grad.to_local()`) into result_dir/rank{rank}.pt, plus tapesac's step
statistics. It never compares anything itself: the test process does, so a failure message shows both values.
Any exception is written to result_dir/rank{rank}.err (with the traceback) before the process exits non-zero.
"""

from __future__ import annotations

import os
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only: nothing outside this machine

import torch
import torch.distributed as dist
import torch.nn as nn

STEPS = 3
D = 32


def _model() -> nn.Module:
    import models as M

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return M.Stack([M.MLPBlock(D, 2 * D), M.AttentionBlock(D, heads=2), M.DropoutBlock(D, p=0.2),
                        M.MLPBlock(D, 2 * D)])


def _wrap(model: nn.Module, engine: str) -> nn.Module:
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        return model
    raise ValueError(engine)


def _inner(wrapped: nn.Module) -> nn.Module:
    return wrapped.module if hasattr(wrapped, "module") else wrapped


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in _inner(model).named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):
            g = g.to_local()
        out[name] = None if g is None else g.detach().clone()
    return out


def _train(model: nn.Module, rank: int, sac=None) -> tuple[list, list, list]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads, stats = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(2, 8, D, generator=g)
        torch.manual_seed(10 * rank + step)  # dropout: rank-specific, identical for both variants
        if sac is None:
            loss = model(x).square().mean()
            loss.backward()
        else:
            with sac.step():
                loss = model(x).square().mean()
                loss.backward()
            st = sac.last_step
            stats.append(dict(ops_recorded=st.ops_recorded, dropped_tensors=st.dropped_tensors,
                              ops_replayed=st.ops_replayed, block_calls=st.block_calls))
        losses.append(loss.detach().clone())
        grads.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, stats


def run(rank: int, world: int, init_file: str, engine: str, policy: str, result_dir: str) -> None:
    try:
        import tapesac

        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            plain = _wrap(_model(), engine)
            ref = _train(plain, rank)
            model = _wrap(_model(), engine)
            sac = tapesac.TapeSAC(model, blocks=list(_inner(model).blocks), policy=policy)
            try:
                got = _train(model, rank, sac)
            finally:
                sac.close()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save({"ref": ref, "got": got}, os.path.join(result_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
