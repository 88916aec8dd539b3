"""tapesac in a Hugging Face ``transformers.Trainer``: ``TapeSACCallback``.

Contract:
- ``TapeSACCallback(sac)`` runs ``sac`` (a TapeSAC made on the model the Trainer trains) through ``sac.attach()``:
  each tapesac step starts at the first block forward of a micro-batch and ends after its backward —
  ``on_substep_end`` for the micro-batches that accumulate, ``on_pre_optimizer_step`` for the last one — so every
  micro-batch of gradient accumulation is one step and none is abandoned. Training is bitwise the same as without
  the callback (tapesac is exact); evaluation (no gradients) starts no step. ``on_train_end`` detaches. A
  ``train()`` that raises reaches no callback: ``add_to(trainer)`` wraps ``trainer.train`` to detach then; a
  callback given in ``callbacks=`` is detached by the next ``train()`` of any TapeSACCallback on the same TapeSAC.
- Logging: at every ``on_log`` that follows new tapesac steps, ``step_metrics`` of those steps (``tapesac/...``
  keys) is added to the logged dict and to ``state.log_history``. The Trainer calls its reporters (TensorBoard,
  W&B, ...) before the callbacks passed in ``callbacks=``; ``add_to(trainer)`` puts the callback first so that the
  reporters receive the tapesac numbers too. ``log=False`` adds nothing.
- Imports only ``transformers`` (never Lightning).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..errors import ConfigError
from .metrics import step_metrics

__all__ = ["TapeSACCallback"]


class TapeSACCallback(TrainerCallback):
    """Runs a TapeSAC inside ``transformers.Trainer``; see the module's contract.

    Example::

        sac = tapesac.TapeSAC(model, blocks="model.layers.*")
        trainer = Trainer(model=model, args=args, train_dataset=data)
        TapeSACCallback(sac).add_to(trainer)   # or Trainer(..., callbacks=[TapeSACCallback(sac)])
        trainer.train()
    """

    def __init__(self, sac: Any, *, log: bool = True) -> None:
        from ..core import TapeSAC

        if not isinstance(sac, TapeSAC):
            raise ConfigError(f"TapeSACCallback expects a tapesac.TapeSAC, got {type(sac).__name__}")
        self.sac = sac
        self.log = log
        self._attachment: Any = None
        self._logged_step = 0  # the last tapesac step whose numbers were logged

    def add_to(self, trainer: Any) -> "TapeSACCallback":
        """Adds this callback to ``trainer`` ahead of its other callbacks (so its reporters log tapesac's numbers),
        and detaches when ``trainer.train()`` raises (HF calls no callback then)."""
        trainer.callback_handler.callbacks.insert(0, self)
        train = trainer.train

        def train_then_detach(*args: Any, **kwargs: Any) -> Any:
            try:
                return train(*args, **kwargs)
            except BaseException:
                self._abandon()
                raise

        trainer.train = train_then_detach
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None and not any(m is self.sac.blocks[0][1] for m in model.modules()):
            raise ConfigError(f"TapeSACCallback: the Trainer trains a {type(model).__name__} whose modules do not "
                              f"include the TapeSAC's blocks ({self.sac.blocks[0][0]}, ...); make the TapeSAC on the "
                              f"model passed to the Trainer")
        # A train() that raised never reached on_train_end: its attachment (this callback's, or another
        # TapeSACCallback's on the same TapeSAC) is still there, maybe with a step open. train() is not reentrant, so
        # it is abandoned and this train() attaches afresh.
        current = self.sac._attachment
        if isinstance(getattr(current, "_hf_callback", None), TapeSACCallback):
            current._hf_callback._abandon()
        self._attachment = self.sac.attach()
        self._attachment._hf_callback = self
        self._logged_step = self.sac.last_step.step if self.sac.last_step else 0

    def _abandon(self) -> None:
        """Ends an open step as failed (its backward may never have run) and detaches."""
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.abandon()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_step()  # a micro-batch that accumulates: its backward is done

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_step()  # the last micro-batch: its backward is done, the optimizer comes next

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self.log or logs is None:
            return
        steps = [s for s in self.sac.history if s.step > self._logged_step]
        if not steps:
            return
        self._logged_step = steps[-1].step
        metrics = step_metrics(steps)
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.detach()

    def _end_step(self) -> None:
        if self._attachment is not None:
            self._attachment.end_step()
