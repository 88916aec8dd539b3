"""tapesac in a Lightning ``Trainer``: ``TapeSACCallback`` (``lightning`` 2.x, or ``pytorch_lightning``).

Contract:
- ``TapeSACCallback(sac)`` runs ``sac`` (a TapeSAC made on the LightningModule or a module inside it) through
  ``sac.attach()``: each tapesac step starts at the first block forward of a training batch and ends at
  ``on_after_backward`` — per micro-batch, so with ``accumulate_grad_batches`` no step is abandoned (the optimizer,
  and ``on_before_optimizer_step``, run only every N batches). ``on_train_batch_end`` ends a step that had no backward
  (``training_step`` returned None); validation (no gradients) starts none; ``on_train_end`` and ``on_exception``
  detach. Training is bitwise the same as without the callback.
- Logging: at ``on_train_batch_end``, ``step_metrics`` of the tapesac steps since the last call goes to
  ``pl_module.log_dict(..., on_step=True, on_epoch=False)``, i.e. to the trainer's loggers. ``log=False`` logs nothing.
- Imports only Lightning (never transformers). Without Lightning installed the class still imports (its base is
  ``object``), so code and tests that drive the hooks themselves run anywhere; a Lightning Trainer needs Lightning.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..log import logger
from .metrics import step_metrics

try:
    from lightning.pytorch import Callback as _Callback
except ImportError:  # the older package name, then none
    try:
        from pytorch_lightning import Callback as _Callback
    except ImportError:
        _Callback = object

__all__ = ["TapeSACCallback"]


class TapeSACCallback(_Callback):  # type: ignore[misc, valid-type]
    """Runs a TapeSAC inside a Lightning Trainer; see the module's contract.

    Example::

        sac = tapesac.TapeSAC(lit_module.model, blocks="model.layers.*")
        trainer = lightning.Trainer(max_steps=100, callbacks=[TapeSACCallback(sac)])
        trainer.fit(lit_module, data)
    """

    def __init__(self, sac: Any, *, log: bool = True) -> None:
        from ..core import TapeSAC

        if not isinstance(sac, TapeSAC):
            raise ConfigError(f"TapeSACCallback expects a tapesac.TapeSAC, got {type(sac).__name__}")
        super().__init__()
        self.sac = sac
        self.log = log
        self._attachment: Any = None
        self._logged_step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not any(m is self.sac.blocks[0][1] for m in pl_module.modules()):
            raise ConfigError(f"TapeSACCallback: the LightningModule {type(pl_module).__name__} does not contain the "
                              f"TapeSAC's blocks ({self.sac.blocks[0][0]}, ...); make the TapeSAC on the module it "
                              f"trains (or on a module inside it)")
        if self._attachment is None:
            self._attachment = self.sac.attach()
        self._logged_step = self.sac.last_step.step if self.sac.last_step else 0

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._end_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._end_step()
        if not self.log:
            return
        steps = [s for s in self.sac.history if s.step > self._logged_step]
        if steps:
            self._logged_step = steps[-1].step
            pl_module.log_dict(step_metrics(steps), on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self._detach()
        except Exception as e:  # noqa: BLE001 - the training's own exception is the one to raise
            logger.warning(f"tapesac: ending the open step after {type(exception).__name__} raised "
                           f"{type(e).__name__}: {e}")

    def _end_step(self) -> None:
        if self._attachment is not None:
            self._attachment.end_step()

    def _detach(self) -> None:
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.detach()
