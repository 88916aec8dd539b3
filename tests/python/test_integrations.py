"""Trainer integrations (tapesac.integrations): a few-step HF Trainer run and a Lightning run, with and without
gradient accumulation, bitwise equal to the same run without tapesac, one tapesac step per micro-batch, statistics
logged through the trainer's logger. Lightning is not a test dependency: its callback is driven in Lightning's hook
order by a fake trainer here (and by a real Lightning Trainer when one is installed).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import models as M

LAYERS = 2


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, M.HF_VOCAB, (n, M.T), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_train(tmp_path, model, accumulate: int, callbacks=(), add_to=None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulate, learning_rate=1e-3, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=list(callbacks))
    if add_to is not None:
        add_to.add_to(trainer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_hf_trainer_is_exact_with_one_step_per_micro_batch(tapesac, tmp_path, accumulate: int) -> None:
    from transformers import TrainerCallback

    from tapesac.integrations.hf import TapeSACCallback

    torch.manual_seed(0)
    model = M.hf_qwen3(LAYERS)
    ref = copy.deepcopy(model)
    seen: list[dict] = []

    class Reporter(TrainerCallback):  # stands for TensorBoard / W&B: a callback that logs what it is given
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))

    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full")
    trainer = _hf_train(tmp_path / "sac", model, accumulate, callbacks=[Reporter()], add_to=TapeSACCallback(sac))
    ref_trainer = _hf_train(tmp_path / "ref", ref, accumulate)

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ref_losses = [h["loss"] for h in ref_trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and losses == ref_losses
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"{name} differs from the run without tapesac"
    hist = sac.history
    assert len(hist) == 3 * accumulate, [s.step for s in hist]  # one tapesac step per micro-batch
    assert all(s.block_calls == LAYERS and s.dropped_tensors > 0 and s.ops_replayed > 0 for s in hist)
    # Logged through the trainer: in its history and, since add_to() put the callback first, to the reporter.
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["tapesac/steps"] == accumulate and h["tapesac/peak_mib"] > 0 and h["tapesac/dropped_mib"] > 0
               for h in logged), logged
    assert sum("tapesac/replay_ms" in s for s in seen) == 3, seen
    assert not sac._attachment  # detached at the end of training
    sac.close()


def test_hf_callback_refuses_a_tapesac_of_another_model(tapesac, tmp_path) -> None:
    from tapesac.integrations.hf import TapeSACCallback

    sac = tapesac.TapeSAC(M.hf_qwen3(LAYERS), blocks="model.layers.*")
    with pytest.raises(tapesac.ConfigError, match="make the TapeSAC on the model"):
        _hf_train(tmp_path, M.hf_qwen3(LAYERS), 1, callbacks=[TapeSACCallback(sac)])
    sac.close()


@pytest.mark.parametrize("how", ["add_to", "callbacks"])
def test_hf_train_that_raises_leaves_nothing_attached_and_can_run_again(tapesac, tmp_path, how: str) -> None:
    """HF has no exception hook: a train() that raised never reached on_train_end, and the TapeSAC stayed attached —
    later forwards with gradients outside the Trainer opened tapesac steps, and a new TapeSACCallback on the same
    TapeSAC was refused ("already attached"), found by an adversarial test. add_to() now detaches when train()
    raises; a callback given in `callbacks=` takes over at the next train() (its own, or another callback's)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tapesac.integrations.hf import TapeSACCallback

    class Boom(TrainerCallback):
        def __init__(self) -> None:
            self.armed = True

        def on_step_end(self, args, state, control, **kwargs):
            if self.armed and state.global_step == 2:
                self.armed = False
                raise RuntimeError("boom")

    torch.manual_seed(0)
    model = M.hf_qwen3(LAYERS)
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full")
    boom = Boom()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    first = TapeSACCallback(sac)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(),
                      callbacks=[boom] + ([first] if how == "callbacks" else []))
    if how == "add_to":
        first.add_to(trainer)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    steps = len(sac.history)
    if how == "add_to":
        assert not sac._attachment  # detached by add_to's wrapper
        ids = _Tokens()[0]["input_ids"][None]
        M.hf_loss(model, ids).backward()  # a plain forward and backward: no tapesac step
        assert len(sac.history) == steps
    # Training again, with a new callback: it takes the attachment over and trains exactly.
    second = TapeSACCallback(sac)
    trainer2 = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[second])
    trainer2.train()
    assert len(sac.history) == steps + 3
    assert not sac._attachment
    sac.close()


class _LitModule(torch.nn.Module):
    """The parts of a LightningModule the callback uses: modules() and log_dict()."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.logged: list[dict] = []

    def log_dict(self, metrics, on_step=None, on_epoch=None, **kwargs):
        assert on_step is True and on_epoch is False
        self.logged.append(dict(metrics))


def _lightning_loop(module, data, accumulate: int, callback=None) -> list[torch.Tensor]:
    """Lightning's automatic optimization, hook by hook: on_train_start; per batch training_step, backward,
    on_after_backward, every `accumulate` batches on_before_optimizer_step + step + zero_grad, on_train_batch_end;
    on_train_end."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    trainer = object()
    cb = callback
    if cb is not None:
        cb.on_train_start(trainer, module)
    losses = []
    for i, ids in enumerate(data):
        loss = M.hf_loss(module.model, ids) / accumulate  # training_step
        loss.backward()
        if cb is not None:
            cb.on_after_backward(trainer, module)
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
        if cb is not None:
            cb.on_train_batch_end(trainer, module, {"loss": loss}, ids, i)
        losses.append(loss.detach())
    if cb is not None:
        cb.on_train_end(trainer, module)
    return losses


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback_in_lightnings_hook_order_is_exact(tapesac, accumulate: int) -> None:
    from tapesac.integrations.lightning import TapeSACCallback

    torch.manual_seed(0)
    module = _LitModule(M.hf_qwen3(LAYERS))
    ref = copy.deepcopy(module)
    data = [torch.randint(0, M.HF_VOCAB, (M.B, M.T)) for _ in range(4)]
    sac = tapesac.TapeSAC(module.model, blocks="model.layers.*", policy="full")
    got = _lightning_loop(module, data, accumulate, TapeSACCallback(sac))
    want = _lightning_loop(ref, data, accumulate)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (name, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name
    hist = sac.history
    assert len(hist) == len(data) and all(s.block_calls == LAYERS and s.dropped_tensors > 0 for s in hist)
    assert len(module.logged) == len(data) and all(m["tapesac/steps"] == 1 for m in module.logged)
    assert sac._attachment is None
    sac.close()


def test_integrations_import_without_the_other_framework(tapesac) -> None:
    """Each integration imports only its framework; the package imports neither."""
    import subprocess

    def run(code: str) -> None:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr

    # The HF callback with Lightning unimportable; the Lightning one with transformers unimportable (its base is
    # `object` when Lightning is absent too); the package imports neither integration.
    run("import sys; sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
        "import tapesac.integrations.hf as hf; assert hf.TapeSACCallback\n")
    run("import sys; sys.modules['transformers'] = None\n"
        "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
        "import tapesac.integrations.lightning as lt; assert lt.TapeSACCallback.__mro__[1] is object\n")
    run("import sys, tapesac.integrations\n"
        "assert not {'tapesac.integrations.hf', 'tapesac.integrations.lightning', 'lightning'} & set(sys.modules)\n")


def test_real_lightning_trainer_with_accumulation_is_exact(tapesac, tmp_path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from tapesac.integrations.lightning import TapeSACCallback

    class Lit(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return M.hf_loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Metrics(pl.loggers.logger.Logger):
        def __init__(self):
            super().__init__()
            self.rows = []

        name, version = "metrics", "0"

        def log_metrics(self, metrics, step=None):
            self.rows.append(dict(metrics))

        def log_hyperparams(self, *args, **kwargs):
            pass

    torch.manual_seed(0)
    model = M.hf_qwen3(LAYERS)
    ref = copy.deepcopy(model)
    data = [torch.randint(0, M.HF_VOCAB, (M.B, M.T)) for _ in range(4)]

    def fit(m, callbacks, logger):
        trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                             callbacks=callbacks, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(Lit(m), torch.utils.data.DataLoader(data, batch_size=None))

    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full")
    metrics = Metrics()
    fit(model, [TapeSACCallback(sac)], metrics)
    fit(ref, [], False)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name
    assert len(sac.history) == 4 and all(s.dropped_tensors > 0 for s in sac.history)
    assert any("tapesac/peak_mib" in r for r in metrics.rows), metrics.rows
    sac.close()
