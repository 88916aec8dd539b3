"""Memory telemetry (issue 3): the counting CPU allocator against torch.profiler, limit enforcement during replay,
no leak over 200 steps, MemoryMeter, the report's JSON / table / plot, the JSON-lines log and its CLI."""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import models as M
from models import stack, x_in
from conftest import assert_same_grads


def _qwen():
    from tapesac.models import tiny_qwen3

    torch.manual_seed(0)
    return tiny_qwen3()


def _tokens(batch=2, seq=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 259, (batch, seq), generator=g)


def _lm_step(model, x):
    model(input_ids=x, labels=x).loss.backward()


def _profiler_peak(prof) -> int:
    """Peak of the cumulative CPU allocations the profiler saw (its memory events, in time order)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"]
    assert events, "the profiler recorded no memory events"
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _collect_all() -> None:
    """Collects until nothing more is freed: garbage an earlier test left (a finalizer's objects go one collection
    later) must not be freed inside a measured region, where it reads as negative retention or negative bytes."""
    import gc

    while gc.collect():
        pass


@pytest.mark.profiler  # last in the session: a profiler session keeps kineto subscribed to CUPTI (conftest)
@pytest.mark.parametrize("policy", ["full", "none", {"aten::mm", "aten::addmm"}])
@pytest.mark.parametrize("which", ["qwen3", "stack"])
def test_peak_agrees_with_profiler(tapesac, policy, which) -> None:
    if which == "qwen3":
        model, run = _qwen(), (lambda m: _lm_step(m, _tokens(4, 128)))
        blocks = "model.layers.*"
    else:
        torch.manual_seed(0)
        model, blocks = stack(), "blocks.*"
        x = x_in()
        run = lambda m: m(x).square().mean().backward()  # noqa: E731
    sac = tapesac.TapeSAC(model, blocks=blocks, policy=policy)
    with sac.step():  # warm-up: first-call allocations (caches) stay out of the measured step
        run(model)
    model.zero_grad(set_to_none=True)
    _collect_all()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with sac.step():
            run(model)
    ours = sac.last_step.memory.peak_above_baseline_bytes
    theirs = _profiler_peak(prof)
    assert ours > 0
    assert abs(ours - theirs) <= 0.01 * theirs, f"tapesac peak {ours} vs profiler {theirs}"
    sac.close()


def test_full_keeps_less_than_none(tapesac) -> None:
    model = _qwen()
    x = _tokens(4, 128)
    peaks = {}
    for policy in ("none", "full"):
        sac = tapesac.TapeSAC(model, policy=policy)
        with sac.step():
            _lm_step(model, x)
        model.zero_grad(set_to_none=True)
        peaks[policy] = sac.last_step.memory
        sac.close()
    assert peaks["full"].peak_bytes < peaks["none"].peak_bytes
    assert peaks["full"].phases["replay"].allocated_bytes > 0
    assert peaks["none"].phases["replay"].allocated_bytes == 0
    # The baseline is the parameters and buffers (no gradients exist at the first step).
    param_bytes = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    assert peaks["full"].baseline_bytes == param_bytes



def _resident_bytes(model: nn.Module) -> int:
    """Parameters, buffers and gradients, each storage once: a step's baseline."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def test_the_baseline_follows_the_model_changing_between_steps(tapesac) -> None:
    """Note [Module tree cache]: the module list is cached across steps, and every way of changing the model between
    steps is seen at the next step's start — a submodule added, replaced or deleted (also through ``_modules``), a
    parameter or buffer reassigned or registered, a parameter swapped through ``_parameters`` (as FSDP2 does)."""
    model = stack(n=2)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    x = x_in()

    def step() -> int:
        model.zero_grad(set_to_none=True)
        with sac.step():
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        return sac.last_step.memory.baseline_bytes

    assert step() == _resident_bytes(model)
    changes = [
        lambda: setattr(model, "extra", nn.Linear(M.D, 64)),                      # a submodule added
        lambda: setattr(model, "extra", nn.Linear(M.D, 128)),                     # replaced (same name)
        lambda: model._modules.__setitem__("extra", nn.Linear(M.D, 256)),         # replaced through _modules
        lambda: setattr(model.extra, "weight", nn.Parameter(torch.zeros(512, M.D))),  # a parameter reassigned
        lambda: model.extra._parameters.__setitem__("bias", nn.Parameter(torch.zeros(999))),  # FSDP2-style swap
        lambda: model.extra.register_buffer("stat", torch.zeros(300)),           # a buffer registered
        lambda: setattr(model.extra, "stat", torch.zeros(700)),                  # a buffer reassigned
        lambda: delattr(model, "extra"),                                         # a submodule deleted
    ]
    for change in changes:
        before = _resident_bytes(model)
        change()
        assert _resident_bytes(model) != before  # each change changes what the model holds
        assert step() == _resident_bytes(model)
    sac.close()

def test_replay_working_set_prediction_matches_measurement(tapesac) -> None:
    model = _qwen()
    sac = tapesac.TapeSAC(model, policy="full")
    with sac.step():
        _lm_step(model, _tokens(4, 128))
    for b in sac.last_step.blocks:
        assert b.replays == 1
        assert b.predicted_replay_bytes > 0
        # Kernel workspaces are not in the prediction; on these CPU kernels there are none beyond their outputs.
        assert abs(b.replay_peak_bytes - b.predicted_replay_bytes) <= 0.05 * b.predicted_replay_bytes, b
    mem = sac.last_step.memory
    assert mem.arena_bytes == max(b.replay_peak_bytes for b in sac.last_step.blocks)
    assert mem.arena_separate_bytes == sum(b.replay_peak_bytes for b in sac.last_step.blocks)
    sac.close()


def test_impossible_limit_raises_with_numbers_and_next_step_works(tapesac) -> None:
    model = _qwen()
    ref = copy.deepcopy(model)
    x = _tokens()
    sac = tapesac.TapeSAC(model, policy="full", memory_limit=1_000_000)
    with tapesac.MemoryMeter() as meter:
        with pytest.raises(tapesac.MemoryLimitError) as ei:
            with sac.step():
                _lm_step(model, x)
        msg = str(ei.value)
        ei.value.__traceback__ = None  # the traceback's frames would keep the step's tensors alive
        del ei
    model.zero_grad(set_to_none=True)
    # Everything the failed step allocated is freed: memory is back at its baseline.
    assert meter.current_bytes == 0, meter.current_bytes
    assert "1000000 bytes" in msg and "model.layers." in msg and "backward" in msg and "at least" in msg, msg
    # Nothing is left behind: the same instance runs a correct step once the limit is lifted.
    sac.memory_limit = None
    assert sac.memory_limit is None
    with sac.step():
        _lm_step(model, x)
    _lm_step(ref, x)
    assert_same_grads(model, ref)
    sac.close()


def test_tight_limit_replays_in_pieces_and_stays_exact(tapesac) -> None:
    model = _qwen()
    ref = copy.deepcopy(model)
    x = _tokens(4, 128)
    # One segment per block call: the replays in pieces are what this checks (planned schedules avoid them).
    sac = tapesac.TapeSAC(model, policy="full", schedule="one_segment")
    with sac.step():
        _lm_step(model, x)
    first = sac.last_step
    free = first.memory
    whole = max(b.predicted_replay_bytes for b in first.blocks)
    model.zero_grad(set_to_none=True)
    # Just under what the whole replay of the last block needs on top of what is in use when it starts.
    sac.memory_limit = free.peak_bytes - whole // 2
    with sac.step():
        _lm_step(model, x)
    st = sac.last_step
    assert st.memory.replay_pieces > 0 and st.replay_pieces == st.memory.replay_pieces
    assert st.replays > first.replays
    split = [b for b in st.blocks if b.replay_pieces > 0]
    assert split and all(b.replay_peak_bytes < whole for b in split), st.blocks
    _lm_step(ref, x)
    assert_same_grads(model, ref)
    sac.close()


def test_memory_limit_forms(tapesac) -> None:
    parse = tapesac.parse_memory_limit
    assert parse(None) is None
    assert parse(123) == 123
    assert parse("20GiB") == 20 * 2**30
    assert parse("1.5 GB") == 1_500_000_000
    assert parse("512MiB") == 512 * 2**20
    assert parse("1e9") == 1_000_000_000
    from tapesac.memory import physical_memory_bytes

    assert parse("50%") == physical_memory_bytes() // 2
    # "0.00000000001%" rounded to 0 bytes, which means no limit (found by an adversarial test).
    for bad in ("-1GiB", "20 parsecs", "0", "150%", "0.00000000001%", 0, -5, 1.5, True, [1], "GiB"):
        with pytest.raises(tapesac.ConfigError) as ei:
            parse(bad)
        assert "memory_limit" in str(ei.value)


def test_flat_peak_over_200_steps(tapesac) -> None:
    model = _qwen()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sac = tapesac.TapeSAC(model, policy="full")
    x = _tokens(2, 32)
    for _ in range(200):
        with sac.step():
            _lm_step(model, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peaks = [s.memory.peak_bytes for s in sac.history]
    ends = [s.memory.end_bytes for s in sac.history]
    assert len(peaks) == 200
    # Every step allocates the same tensors: the peak and what a step leaves alive (the gradients) never grow.
    assert max(peaks[1:]) == min(peaks[1:]), (min(peaks[1:]), max(peaks[1:]))
    assert max(ends) == min(ends)
    sac.close()


def test_memory_meter_counts_exactly_and_nests(tapesac) -> None:
    with tapesac.MemoryMeter() as outer:
        a = torch.empty(1000)  # 4000 bytes
        with tapesac.MemoryMeter() as inner:
            b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
            del b
        assert inner.peak_bytes == 4000 and inner.current_bytes == 0 and inner.allocated_bytes == 4000
        assert outer.current_bytes == 4000
    assert outer.peak_bytes == 8000
    del a
    assert outer.current_bytes == 0  # frees after the block still reach the meter
    with pytest.raises(tapesac.ConfigError):
        tapesac.MemoryMeter(device="meta")


def test_memory_meter_around_a_step_sees_the_step_peak(tapesac) -> None:
    model = _qwen()
    sac = tapesac.TapeSAC(model, policy="full")
    x = _tokens()
    with sac.step():
        _lm_step(model, x)
    model.zero_grad(set_to_none=True)
    with tapesac.MemoryMeter() as m:
        with sac.step():
            _lm_step(model, x)
    assert m.peak_bytes == sac.last_step.memory.peak_above_baseline_bytes
    sac.close()


def test_counting_allocator_removed_after_close(tapesac) -> None:
    from tapesac import _C

    model = _qwen()
    sac = tapesac.TapeSAC(model, policy="full")
    with sac.step():
        _lm_step(model, _tokens())
    assert _C.counting_allocator_installed()
    sac.close()
    assert not _C.counting_allocator_installed()


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_json_round_trip_pretty_and_plot(tapesac, tmp_path) -> None:
    model = _qwen()
    sac = tapesac.TapeSAC(model, policy="full")
    for _ in range(2):
        with sac.step():
            _lm_step(model, _tokens())
        model.zero_grad(set_to_none=True)
    rep = sac.report()
    from tapesac.report import SCHEMA_VERSION

    assert rep.schema_version == SCHEMA_VERSION
    back = tapesac.StepReport.from_dict(json.loads(rep.to_json(tmp_path / "r.json")))
    assert back == rep
    assert json.loads((tmp_path / "r.json").read_text())["last"]["memory"]["peak_bytes"] == rep.last["memory"]["peak_bytes"]
    text = rep.pretty()
    for word in ("step peak", "baseline", "forward", "backward", "replay", "model.layers.0"):
        assert word in text, text
    assert rep.timeline["points"] and rep.timeline["spans"]
    w, h = _png_size(rep.plot(tmp_path / "r.png"))
    assert w > 300 and h > 300
    with pytest.raises(tapesac.ConfigError):
        tapesac.StepReport.from_dict({**rep.to_dict(), "schema_version": 999})
    sac.close()


def test_report_outputs_to_a_bad_path_are_config_errors_and_leak_no_figure(tapesac, tmp_path) -> None:
    """An adversarial test: plot() / to_json() / Frontier.plot() to a missing folder or an unknown image format raised
    an untyped OSError / ValueError, and each failed plot left its matplotlib figure open."""
    import matplotlib.pyplot as plt

    model = _qwen()
    sac = tapesac.TapeSAC(model, memory_limit="90%")  # auto: frontier() needs it
    for _ in range(2):
        with sac.step():
            _lm_step(model, _tokens())
        model.zero_grad(set_to_none=True)
    rep, front = sac.report(), sac.frontier(points=4)
    figures = len(plt.get_fignums())
    bad = [lambda: rep.plot(tmp_path / "missing" / "r.png"), lambda: rep.plot(tmp_path / "r.notaformat"),
           lambda: rep.to_json(tmp_path / "missing" / "r.json"), lambda: front.plot(tmp_path / "missing" / "f.png"),
           lambda: front.plot(tmp_path / "f.notaformat"), lambda: rep.to_json(tmp_path)]
    for call in bad:
        with pytest.raises(tapesac.ConfigError, match="cannot write"):
            call()
    assert len(plt.get_fignums()) == figures
    assert not list(tmp_path.iterdir())  # nothing half-written
    sac.close()


def test_jsonl_log_and_report_cli(tapesac, tmp_path, capsys) -> None:
    from tapesac import cli

    model = _qwen()
    logs = []
    for policy in ("none", "full"):
        log = tmp_path / f"{policy}.jsonl"
        sac = tapesac.TapeSAC(model, policy=policy, log=log)
        for _ in range(3):
            with sac.step():
                _lm_step(model, _tokens())
            model.zero_grad(set_to_none=True)
        sac.close()
        lines = log.read_text().splitlines()
        assert len(lines) == 3
        rec = json.loads(lines[-1])
        assert rec["kind"] == "step" and rec["policy"] == policy and rec["memory"]["peak_bytes"] > 0
        logs.append(log)
    from_log = tapesac.StepReport.from_jsonl(logs[0])
    assert from_log.steps == 3 and from_log.timeline["points"]  # step 2 logged its timeline
    png = tmp_path / "cmp.png"
    assert cli.main(["report", str(logs[0]), str(logs[1]), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "policy 'none'" in out and "policy 'full'" in out and "step peak" in out
    _png_size(png)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert cli.main(["report", str(bad)]) == 2
    with pytest.raises(tapesac.ConfigError):
        tapesac.TapeSAC(model, log=tmp_path / "missing-dir" / "x.jsonl")
    with pytest.raises(tapesac.ConfigError):
        tapesac.TapeSAC(model, log=123)


def test_history_is_bounded(tapesac) -> None:
    from tapesac import core

    torch.manual_seed(0)
    model = stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    assert sac._history.maxlen == core.HISTORY_STEPS == 1000
    sac._history = core.collections.deque(maxlen=5)  # the same deque the constructor makes, smaller
    for _ in range(8):
        with sac.step():
            model(x_in()).square().mean().backward()
    assert len(sac.history) == 5 and sac.history[-1].step == 8
    assert sac.report().steps == 8 and len(sac.report().peaks) == 5
    sac.close()


def test_history_keeps_per_block_detail_for_the_last_steps_only(tapesac) -> None:
    """Note [History without per-block detail]: every StepStats stays in the history, its per-block tuple only for the
    last HISTORY_BLOCK_STEPS steps (older: blocks=(), block_calls and the totals intact); the report is unchanged;
    and a long run no longer keeps one BlockStats per block call per step alive."""
    import gc

    from tapesac import core

    torch.manual_seed(0)
    model = stack()
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    keep = core.HISTORY_BLOCK_STEPS
    assert keep == 16
    n = keep + 4
    for _ in range(n):
        with sac.step():
            model(x_in()).square().mean().backward()
    hist = sac.history
    assert [st.step for st in hist] == list(range(1, n + 1))
    for st in hist[:-keep]:
        assert st.blocks == () and st.block_calls == 2 and st.saved_tensors > 0 and st.memory is not None, st
    for st in hist[-keep:]:
        assert len(st.blocks) == st.block_calls == 2, st
    old, new = hist[0], hist[-1]
    assert (old.saved_tensors, old.dropped_bytes) == (new.saved_tensors, new.dropped_bytes)
    assert sac.report().steps == n and len(sac.report().peaks) == n
    assert sac.report().last["blocks"] and len(sac.report().last["blocks"]) == 2
    sac.close()
    # The objects a step leaves alive no longer grow with its block calls once the detail is dropped: a 24-block
    # model retains as many per step as a 2-block one (each BlockStats kept added 1-2 objects per block call).
    retained = {}
    for n_blocks in (2, 24):
        torch.manual_seed(0)
        model = stack(n_blocks)
        sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
        for _ in range(keep + 2):
            with sac.step():
                model(x_in()).square().mean().backward()
        _collect_all()
        before = len(gc.get_objects())
        for _ in range(10):
            with sac.step():
                model(x_in()).square().mean().backward()
        gc.collect()
        retained[n_blocks] = (len(gc.get_objects()) - before) / 10
        sac.close()
    assert retained[24] <= retained[2] + 1, retained


def test_a_log_appended_by_two_runs_reports_the_last_run(tapesac, tmp_path) -> None:
    """Found by an adversarial test: two TapeSACs logging to one path (logs are appended: a reused --log) made
    from_jsonl label the report with the last policy but take its medians and peaks over both runs. A run starts where
    the step numbers start again: the report is the last run's, equal to its live report."""
    model = _qwen()
    log = tmp_path / "shared.jsonl"
    live = {}
    for policy in ("none", "full"):
        sac = tapesac.TapeSAC(model, policy=policy, log=log)
        for _ in range(3):
            with sac.step():
                _lm_step(model, _tokens())
            model.zero_grad(set_to_none=True)
        live[policy] = sac.report()
        sac.close()
    assert len(log.read_text().splitlines()) == 6
    rep = tapesac.StepReport.from_jsonl(log)
    assert rep.policy == "full" and rep.steps == 3, (rep.policy, rep.steps)
    assert rep.peaks == live["full"].peaks and rep.median_step_ms == live["full"].median_step_ms


def test_a_log_whose_last_line_was_cut_reports_the_lines_before(tapesac, tmp_path, caplog) -> None:
    """A run killed while writing leaves its last record cut off (no newline): the whole log was refused ("not a JSON
    line", an adversarial test). The cut line is skipped with a warning; a bad line elsewhere is still refused."""
    import logging

    model = _qwen()
    log = tmp_path / "killed.jsonl"
    sac = tapesac.TapeSAC(model, policy="full", log=log)
    for _ in range(3):
        with sac.step():
            _lm_step(model, _tokens())
        model.zero_grad(set_to_none=True)
    sac.close()
    whole = log.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(whole + whole.splitlines()[0][:40])
    with caplog.at_level(logging.WARNING, logger="tapesac"):
        rep = tapesac.StepReport.from_jsonl(cut)
    assert rep.steps == 3 and any("cut off" in r.getMessage() for r in caplog.records)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(whole.splitlines()[0][:40] + "\n" + whole)
    with pytest.raises(tapesac.ConfigError, match="not a JSON line"):
        tapesac.StepReport.from_jsonl(bad)
