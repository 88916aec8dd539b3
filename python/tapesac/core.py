"""The TapeSAC front: the object a user makes, and ``sac.step()``, the context manager around one training step.

Contract: ``TapeSAC(model, ...)`` never edits the model (its code, attributes or ``state_dict`` keys). The step's
hooks exist only inside ``with sac.step():`` and are removed in ``finally`` — also when the step raised; between
steps only the conflict watch (conflicts.py: a post-accumulate-grad hook on one parameter per block, no module hook)
and, after ``sac.attach(...)``, the step-free mode's hooks (attach.py) remain, until ``close()``. A step context that is abandoned (entered, never exited, then garbage-collected) is ended with a
warning; entering a step while one is open raises. Everything that runs per op or per saved tensor is C++
(``tapesac._C``); this module runs per step. Its parts: the options (config.py), where tapesac applies (blocks.py),
policies (policy.py), the step's hooks (hooks.py), statistics (stats.py), files (logs.py), warnings (log.py,
conflicts.py), the step-free mode (attach.py), the C++ session made from the options (session_setup.py).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from . import _C
from .attach import Attachment, check_not_attached, nesting_message
from .blocks import ModelTensors, check_blocks, model_device, resolve_backend, resolve_blocks
from .config import Approx, Config, options_doc, resolve_schedule
from .conflicts import Conflicts, remove_handles
from .errors import ConfigError, TapeSACError
from .hooks import StepHooks
from .log import Once, logger
from .logs import StepLog
from .memory import MemoryStats, parse_memory_limit
from .policy import CallablePolicy, OpSetPolicy, parse_policy
from .preserve import Trial
from .session_setup import make_session
from .stats import BlockStats, StepStats, append_to_history, blocks_on_demand, capture_errors, step_stats_from
from .step_context import StepContext

__all__ = ["TapeSAC", "Approx", "Config", "StepStats", "BlockStats", "record_ops"]

HISTORY_STEPS = 1000
# The history keeps each step's per-block statistics (StepStats.blocks) for its last HISTORY_BLOCK_STEPS steps only:
# Note [History without per-block detail].
HISTORY_BLOCK_STEPS = 16

# Thread ident -> the TapeSAC whose step is open on it. Not a threading.local: a step exited on another thread than
# the one it was entered on cleared that thread's marker and left the entering thread unable to step, for good.
# Weak: a TapeSAC dropped with a step open (an attached step whose backward raised) must stay collectable, else every
# later TapeSAC on the thread was refused as nesting (an adversarial test).
_active_steps: "weakref.WeakValueDictionary[int, TapeSAC]" = weakref.WeakValueDictionary()



def record_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """Runs ``fn(*args, **kwargs)`` once with the C++ recorder active and returns the ops it recorded.

    The names are those autograd sees (composite ops decomposed): ``"ns::name"`` for a default overload,
    ``"ns::name.overload"`` otherwise — the same as ``func._schema`` in a ``TorchDispatchMode``.
    """
    if not callable(fn):
        raise ConfigError(f"record_ops expects a callable (a function or an nn.Module), got {type(fn).__name__}")
    return list(_C.record_ops(fn, *args, **kwargs))


class TapeSAC:
    """Automatic selective activation checkpointing for the blocks of ``model``.

    ``TapeSAC(model, **options)`` or ``TapeSAC(model, config)`` (a ``tapesac.Config``; keywords then override it).

    Args:
        model: the nn.Module trained; not modified.
{options}
    """

    def __init__(self, model: nn.Module, config: Config | None = None, **options: Any) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"TapeSAC expects the model as a torch.nn.Module, got {type(model).__name__}")
        if config is not None and not isinstance(config, Config):
            raise ConfigError(f"TapeSAC(model, config): config must be a tapesac.Config, got {type(config).__name__}; "
                              f"pass the other options as keywords (e.g. policy='full')")
        cfg = config.replace(**options) if config is not None else Config.from_options(options)
        self.config = cfg
        self._device = model_device(model)
        limit = parse_memory_limit(cfg.memory_limit, self._device)
        policy = cfg.policy if cfg.policy is not None else ("auto" if limit is not None else "full")
        self.backend = resolve_backend(cfg.backend, self._device)
        self._model = model
        self._blocks = resolve_blocks(model, cfg.blocks)
        self._block_names = [n for n, _ in self._blocks]
        # Parameters and buffers, read at each step's start; a changed module tree re-checks the blocks.
        self._tensors = ModelTensors(model, lambda: check_blocks(model, cfg.blocks, self._blocks))
        self._policy_label, session_policy, save_op = parse_policy(policy)
        self._save_op = save_op
        check = cfg.contract != "off"
        preserve = cfg.preserve
        self._session, self._arena_pool = make_session(
            cfg, session_policy, save_op, limit or 0, self._device, self.backend,
            device_timing=self._device.type == "cuda" and self._policy_label == "auto")
        self._approx = cfg.approx
        self._limit = limit or 0
        # Between steps (runtime/runtime.h): the planner of policy "auto" and the preservation choice.
        # schedule="planned": the planner also plans the replay schedules (of "full", op sets, callables: only those).
        self.schedule = resolve_schedule(cfg.schedule, self._policy_label, cfg.approx is not None)
        self._runtime = _C.Runtime(self._session, plan=self._policy_label == "auto", memory_limit=self._limit,
                                   preserve=preserve if check else "off", schedules=self.schedule == "planned",
                                   schedule_budget=-1.0 if cfg.schedule_budget is None else float(cfg.schedule_budget))
        if self.schedule in ("hold_all", "lazy"):
            self._session.force_schedule(self.schedule)
        self._planner = self._runtime.planner  # None unless policy "auto" or schedule="planned"
        self._log = StepLog(cfg.log, cfg.records)
        self._hooks = StepHooks(self._session, self._blocks)
        self._timeline: dict[str, Any] | None = {}
        self._steps = 0
        self._last: StepStats | None = None
        # The last HISTORY_STEPS steps (a 40,000-step run must not grow host memory step by step).
        self._history: collections.deque[StepStats] = collections.deque(maxlen=HISTORY_STEPS)
        self._closed = False
        self._warned_unmatched = False
        self._in_step = False
        self._once = Once()
        self._attachment: Attachment | None = None
        # Last: the conflict checks warn about this model and its blocks, and watch them between steps.
        self._conflicts = Conflicts(model, self._blocks, self._session)
        # Note [A finalizer that holds no model] (conflicts.remove_handles): collected unclosed, its hooks go too.
        weakref.finalize(self, remove_handles, *self._conflicts.handle_lists())

    # -- properties -------------------------------------------------------------------------------------------
    @property
    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The (qualified name, module) pairs recorded as blocks (none after close())."""
        return list(self._blocks)

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the most recent finished step (None before the first)."""
        return self._last

    @property
    def history(self) -> list[StepStats]:
        """Statistics of the last ``HISTORY_STEPS`` (1000) steps, oldest first; the per-block ``blocks`` of the last
        ``HISTORY_BLOCK_STEPS`` (16) only, ``()`` in older ones (Note [History without per-block detail]; every step
        whole: ``TapeSAC(log=...)``)."""
        return list(self._history)

    @property
    def last_records(self) -> list[dict[str, Any]]:
        """Execution records of the last step: one per replayed value (block, value, op, status, bytes, time_ns,
        detail), including the one a rejected or divergent replay was for."""
        return self._log.last_records()

    @property
    def in_step(self) -> bool:
        """True while a step is open (``with sac.step():``, or between the start and end of an attached step)."""
        return self._in_step

    @property
    def approx(self) -> Approx | None:
        """The approximation in use (None: exact replay)."""
        return self._approx

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self) -> StepContext:
        """Context manager around one training step (forward and backward both inside): ``with sac.step():`` in the
        loop, one per step (the object it returns is entered once; entering it again raises TapeSACError)."""
        return StepContext(self._step_context())

    @contextlib.contextmanager
    def _step_context(self) -> Iterator["TapeSAC"]:
        if self._closed:
            raise TapeSACError("this TapeSAC was closed; create a new one to train with tapesac again")
        thread = threading.get_ident()
        active = _active_steps.get(thread)
        if active is None and self._in_step:  # before anything of the open step is touched (adversarial test)
            raise TapeSACError("sac.step() entered while a step of this TapeSAC is open on another thread; one "
                               "TapeSAC runs one step at a time (train two models with two TapeSACs)")
        if active is not None:
            raise TapeSACError(nesting_message(active, "the same" if active is self else "another"))
        params = self._tensors()
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        # The step's enforced limit (none while measuring); a plan the grown baseline would put over the limit is
        # replaced first, or the step refused (MemoryLimitError) before anything of it is installed (Note [Baseline
        # grown before the step], runtime/src/runtime.cpp).
        self._runtime.before_step(params)
        start = time.perf_counter()
        abandoned = began = False
        try:  # from here on everything installed is undone in `finally`, also after a KeyboardInterrupt
            self._conflicts.before_step()
            self._session.begin_step(params)
            began = True
            _active_steps[thread] = self
            self._in_step = True
            self._hooks.install()
            yield self
        except GeneratorExit:
            abandoned = True  # closed without __exit__: garbage-collected (or closed) while the step was open
            raise
        except RuntimeError as e:
            if not isinstance(e, TapeSACError) and "support saved tensor hooks" in str(e):
                raise TapeSACError(
                    "tapesac: a torch.func transform (grad, vjp, jacrev, hessian) ran inside the forward of a block "
                    "tapesac records, and torch.func refuses saved-tensor hooks. Call the transform outside the "
                    "blocks' forward (a transform over whole blocks runs untouched, its tensors kept), or leave this "
                    "block out of `blocks=`.") from e
            raise
        finally:
            self._end_step(thread, began, abandoned, start)
        if self._closed:  # closed inside the step: nothing of it is measured or planned
            return
        self._raise_policy_error()
        # Only after a step that finished: plan (policy "auto") and choose preservation from what it measured.
        self._runtime.after_step(self._last.memory.peak_bytes if self._last.memory else 0, self._last.step)
        # After planning: a limit the planner finds infeasible raises MemoryLimitError instead (one message, not two).
        self._warn_over_limit()

    def _end_step(self, thread: int, began: bool, abandoned: bool, start: float) -> None:
        """The step's `finally`: hooks removed, session step ended (unless close() did), the step counted if it began."""
        closed = self._closed  # sac.close() inside the step removed its hooks and ended it
        try:
            if not closed:
                try:
                    try:
                        self._hooks.remove()
                    except BaseException:  # an interrupt landed inside: once more (Note [Hooks removed whatever
                        self._hooks.remove()  # interrupts], hooks.py), then it propagates
                        raise
                finally:
                    self._session.end_step()
        finally:
            self._leave_step(thread)
        if closed:  # nothing of a step close() ended is counted
            return
        if not began:  # begin_step raised, or an interrupt came before it returned
            return self._conflicts.after_step(None)
        self._steps += 1
        self._last = self._collect(time.perf_counter() - start)
        append_to_history(self._history, self._last, HISTORY_BLOCK_STEPS)
        self._conflicts.after_step(self._last)
        self._warn_unmatched()
        self._log.write_step(self._last, self._get_timeline)
        self._log.write_records(self._steps, self._session)
        if abandoned:
            logger.warning(
                f"tapesac: the context of step {self._steps} was abandoned: sac.step() was entered and never exited, "
                f"and the step ended only when Python collected the context (a later step, the plan and the "
                f"statistics may have been wrong meanwhile). Exit every step you enter: `with sac.step():` around "
                f"forward and backward, or __exit__ after the backward in a callback; or let tapesac delimit the "
                f"steps (sac.attach(optimizer), tapesac.integrations).")

    @property
    def preservation_trials(self) -> list[Trial]:
        """preserve="auto": the trials (mode, peak, cost, measured) the choice was made from; under a memory_limit a
        mode whose bound did not fit is listed untried (measured False) and never chosen."""
        return [Trial(*t) for t in self._runtime.preservation_trials]

    @property
    def preservation(self) -> dict[int, str]:
        """preserve="auto"/"keep": the mode chosen per written storage (keys are storage identities)."""
        return dict(self._runtime.preservation)

    def _get_timeline(self) -> dict[str, Any]:
        """The last step's memory timeline, converted from the session on first use (valid until the next step ends)."""
        if self._timeline is None:
            raw = self._session.last_memory()
            self._timeline = {"timeline": [list(p) for p in raw["timeline"]],
                              "spans": [list(sp) for sp in raw["spans"]]}
        return self._timeline

    def _collect(self, seconds: float) -> StepStats:
        rows = self._session.last_stats_rows()
        for name, error in capture_errors(rows):
            self._once.warning(("capture", name, error), f"tapesac: block {name}: {error}; its tensors were kept")
        blocks = blocks_on_demand(rows)  # Note [Block statistics on demand] (stats.py)
        raw = self._session.last_memory(timeline=False)  # the timeline is converted on demand (_get_timeline)
        cuda_peak = None
        if self._device.type == "cuda":
            cuda_peak = int(torch.cuda.max_memory_allocated(self._device))
        memory = MemoryStats.from_session(raw, str(self._device), cuda_peak)
        self._timeline = None  # the session's last step; see _get_timeline
        return step_stats_from(
            summary=self._session.last_summary(),
            blocks=blocks,
            memory=memory,
            step=self._steps,
            policy=self._policy_label,
            step_ms=seconds * 1e3,
            ops_replayed_by_name=dict(self._session.last_replayed_by_name()),
            preserved=tuple(dict(p) for p in self._session.last_preserved()),
        )

    def _warn_over_limit(self) -> None:
        """The limit is a promise (README, "Memory limit and the planner"): a step over it is flagged in StepStats
        (over_limit, over_limit_bytes) and, the first time, warned through the "tapesac" logger."""
        st = self._last
        if st is None or not st.over_limit:
            return
        peak = st.memory.peak_bytes if st.memory else 0
        self._once.warning("over_limit", f"tapesac: step {st.step} peaked at {peak} bytes, {st.over_limit_bytes} bytes "
                           f"over memory_limit {self._limit} (policy {st.policy}); "
                           + ("the planner plans the next step under a tighter margin. " if self._planner is not None
                              else "replay bounds only its own allocations: keep more (policy 'auto', an op set) or "
                                   "schedule='planned'. ")
                           + "StepStats.over_limit flags every such step; this is warned once.")

    def _raise_policy_error(self) -> None:
        """A policy callable that raised (its blocks kept everything, so the step was exact) reaches the user."""
        error = self._save_op.take_error() if isinstance(self._save_op, CallablePolicy) else None
        if error is None:
            return
        op, e = error
        blocks = [b.name for b in (self._last.blocks if self._last else ()) if "policy callable" in b.capture_error]
        where = f" in block {blocks[0]!r}" if blocks else ""
        raise ConfigError(
            f"tapesac: the policy callable raised {type(e).__name__}: {e} (deciding op {op!r}{where}); it must return "
            f"True (keep the op's output) or False (drop it) for every op name. This step kept everything, so its "
            f"gradients are exact.") from e

    def _warn_unmatched(self) -> None:
        if self._warned_unmatched or not isinstance(self._save_op, OpSetPolicy) or not self._last:
            return
        if self._last.ops_recorded == 0:
            return
        unmatched = self._save_op.unmatched()
        if unmatched:
            self._warned_unmatched = True
            logger.warning(
                f"tapesac: policy entries {unmatched!r} matched no op whose output a block saved for backward, so "
                f"they keep nothing; check the names (ops are named as autograd sees them, e.g. 'aten::mm', "
                f"'aten::addmm', 'aten::bmm'; tapesac.record_ops(block, *inputs) lists a block's ops)")

    @property
    def plan(self) -> dict[str, Any] | None:
        """The plan in use, else None (before the first plan, policy "none"): predicted peak and replay cost, per block
        call kept bytes and the replay schedule (segments, held_bytes). Policy "auto" plans what to keep and the
        schedules; "full", op sets and callables only the schedules (the least peak, or under memory_limit)."""
        return self._runtime.plan

    def frontier(self, points: int = 12) -> "Frontier":
        """Policy "auto": the planner's memory/time frontier for the current tapes — the best plan's predicted step
        peak and replay time at ``points`` limits from the smallest feasible peak to the keep-everything peak —
        plus the steps measured so far. Needs one finished step."""
        from .frontier import Frontier

        if self._policy_label != "auto" or self._runtime.plan is None or self._closed:
            raise TapeSACError("frontier() needs policy='auto' (a memory_limit) and one finished step"
                               + ("; this TapeSAC was closed (its tapes are gone)" if self._closed else ""))
        if not isinstance(points, int) or isinstance(points, bool) or not 2 <= points <= 1000:
            raise ConfigError(f"frontier(points={points!r}): expected an int in [2, 1000]")
        planned = [
            {"limit_bytes": lim, "predicted_peak_bytes": peak, "predicted_replay_ms": cost / 1e6, "kept_bytes": kept}
            for lim, peak, cost, kept in self._runtime.frontier(points)
        ]
        measured = [
            {"step": st.step, "peak_bytes": st.memory.peak_bytes if st.memory else 0, "replay_ms": st.replay_ms,
             "step_ms": st.step_ms, "policy": st.policy}
            for st in self._history
        ]
        return Frontier(planned=planned, measured=measured, limit_bytes=self._limit)

    @property
    def plans(self) -> list[dict[str, Any]]:
        """The last 1,000 plans made (why, after which step, predicted vs measured peak); see ``plan``."""
        return self._runtime.plans

    @property
    def memory_limit(self) -> int | None:
        """The step-peak limit in bytes (None: no limit). Settable with the same forms as the constructor."""
        return self._limit or None

    @memory_limit.setter
    def memory_limit(self, value: Any) -> None:
        if self._in_step and self._attachment is not None and self._session.backward_failed:
            self._attachment._end_failed()  # an attached step whose backward raised: ended, as at the next forward
        if self._in_step or self._closed:  # refused half-way, the runtime still enforced it (adversarial tests)
            raise TapeSACError("sac.memory_limit can be set only between steps (after the step's `with` block)"
                               if not self._closed else "sac.memory_limit set on a closed TapeSAC; make a new one")
        limit = parse_memory_limit(value, self._device) or 0
        # The session's and the graphs' limit; preserve="auto" chooses again; "auto" re-plans after the next step.
        self._runtime.set_memory_limit(limit)
        self._limit = limit

    def report(self) -> "StepReport":
        """A StepReport of the steps run so far (the last step in detail)."""
        from .report import StepReport

        return StepReport.from_history(self._history, blocks=self._block_names, timeline=self._get_timeline(),
                                       total_steps=self._steps)

    def attach(self, optimizer: torch.optim.Optimizer | None = None) -> Attachment:
        """The step-free mode, for code that cannot wrap its step in ``with sac.step():``: a step starts at the first
        block forward (with gradients) and ends at the next ``optimizer.step()`` — or at ``end_step()`` on the
        returned Attachment when ``optimizer`` is None. A backward that reaches tensors of a step that already ended
        raises TapeSACError. ``detach()`` (or ``close()``, or leaving ``with sac.attach(opt):``) ends it."""
        if self._closed:
            raise TapeSACError("this TapeSAC was closed; create a new one to train with tapesac again")
        check_not_attached(self)
        self._attachment = Attachment(self, optimizer)
        return self._attachment

    def _leave_step(self, thread: int) -> None:
        """This TapeSAC's step on `thread` is over (its `with` exits, or close() ended it inside)."""
        if _active_steps.get(thread) is self:
            del _active_steps[thread]
        self._in_step = False

    def close(self) -> None:
        """Ends any open step and releases the runtime; the model is left exactly as it was, and no longer referenced
        (a closed TapeSAC held for its report kept the model and its gradients alive: an adversarial test)."""
        if self._closed:
            return
        if self._in_step and _active_steps.get(threading.get_ident()) is not self:
            # The step's saved-tensor hooks and its memory counter live in the step thread's thread-locals: ended
            # from here they stayed there, and the step thread's next allocations counted into a freed counter (an
            # adversarial test: heap corruption after the TapeSAC was dropped).
            raise TapeSACError("sac.close() called from another thread while a step of this TapeSAC is open on its "
                               "own thread; close it from the step's thread, or after the step ends")
        if self._attachment is not None:
            self._attachment.detach()
        self._conflicts.close()
        self._hooks.remove()  # inside an open step (its `with` exits after this): its hooks go too
        if self._in_step:  # the step is over: another TapeSAC may start one inside the same `with` block
            self._leave_step(threading.get_ident())
        self._get_timeline()  # report() after close() still shows the last step's timeline
        self._session.shutdown()
        self._log.close()
        self._closed = True
        self._model = self._tensors = self._hooks = self._conflicts = self._attachment = None
        self._blocks = []

    def __repr__(self) -> str:
        return f"TapeSAC(blocks={len(self._block_names)}, policy={self._policy_label!r}, steps={self._steps})"


TapeSAC.__doc__ = (TapeSAC.__doc__ or "").replace("{options}", options_doc())
TapeSAC.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
     inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=nn.Module),
     inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
       for f in __import__("dataclasses").fields(Config)])
