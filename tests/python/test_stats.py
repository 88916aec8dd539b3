"""BlockStats and StepStats are built from the C++ field list (README "Development", Note [Statistics defined once]):
the Python fields follow the schema with the one unit conversion (_ns -> _ms), a step's totals (summed in C++) equal
the sums over its block calls, every field is documented, and str() is a one-line summary."""

from __future__ import annotations

import dataclasses

import pytest

import models as M


def _run(tapesac, policy: str, n: int = 3):
    model = M.stack(n)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy=policy)
    x = M.x_in()
    with sac.step():
        model(x).sum().backward()
    st = sac.last_step
    sac.close()
    return st


def test_fields_follow_the_cpp_schema_with_one_unit_conversion(tapesac) -> None:
    schema = tapesac._C.block_stats_schema()
    names = {f.name for f in dataclasses.fields(tapesac.BlockStats)}
    for name, kind, summed, doc in schema:
        py = name[:-3] + "_ms" if name.endswith("_ns") else name
        assert py in names, f"{name} from C++ is missing in BlockStats"
        assert doc, name
    assert len(names) == len(schema)
    step_names = {f.name for f in dataclasses.fields(tapesac.StepStats)}
    summed = {(n[:-3] + "_ms" if n.endswith("_ns") else n) for n, _, s, _ in schema if s}
    assert summed <= step_names
    assert {"replay_ms", "graph_device_ms", "unpacks", "saved_tensors", "approx_mlp"} <= summed
    for f in ("replay_peak_bytes", "name", "graph_fallback"):
        assert f not in summed


@pytest.mark.parametrize("policy", ["none", "full"])
def test_step_totals_are_the_sums_over_block_calls(tapesac, policy: str) -> None:
    st = _run(tapesac, policy)
    assert st.block_calls == len(st.blocks) == 3
    summed = [n for n, _, s, _ in tapesac._C.block_stats_schema() if s]
    for name in summed:
        py = name[:-3] + "_ms" if name.endswith("_ns") else name
        total = sum(getattr(b, py) for b in st.blocks)
        assert getattr(st, py) == pytest.approx(total), py
    # The demonstration counter (one line in block_stats.h, one where it is counted): every tensor an MLP block
    # saves is unpacked once by its backward, kept or rebuilt.
    assert st.unpacks == st.saved_tensors > 0
    assert all(b.unpacks == b.saved_tensors for b in st.blocks)
    if policy == "full":
        assert st.replays > 0 and st.replay_ms > 0


def test_stats_built_each_step_equal_what_their_constructors_build(tapesac) -> None:
    """The stats are built without the dataclasses' __init__ (memory.frozen_from: a step builds one per block call):
    every field is set, the objects equal (and hash like) the constructors' and stay frozen."""
    from tapesac.memory import MemoryStats, PhaseMemory

    st = _run(tapesac, "full")

    def rebuilt(obj):
        return type(obj)(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})

    for obj in [st, st.memory, *st.blocks, *st.memory.phases.values()]:
        assert set(vars(obj)) == {f.name for f in dataclasses.fields(obj)}, type(obj).__name__
        assert obj == rebuilt(obj) and repr(obj) == repr(rebuilt(obj)), type(obj).__name__
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, dataclasses.fields(obj)[0].name, None)
    assert isinstance(st.memory, MemoryStats) and all(isinstance(p, PhaseMemory) for p in st.memory.phases.values())
    assert hash(st.blocks[0]) == hash(rebuilt(st.blocks[0]))
    assert dataclasses.asdict(st)["blocks"][0]["name"] == st.blocks[0].name


def test_block_stats_from_rows_equal_those_from_dicts(tapesac) -> None:
    """A step builds its BlockStats from value rows in schema order (Session.last_stats_rows()); they equal those
    built from the named dicts (Session.last_stats()), units converted alike."""
    from tapesac.stats import block_stats_from

    model = M.stack(2)
    sac = tapesac.TapeSAC(model, blocks="blocks.*", policy="full")
    try:
        with sac.step():
            model(M.x_in()).sum().backward()
        rows, dicts = sac._session.last_stats_rows(), sac._session.last_stats()
        assert len(rows) == len(dicts) == 2
        for row, d in zip(rows, dicts):
            assert len(row) == len(tapesac._C.block_stats_schema())
            assert block_stats_from(row) == block_stats_from(d)
            assert block_stats_from(row).replay_ms == d["replay_ns"] * 1e-6 and d["replay_ns"] > 0
        assert tuple(block_stats_from(r) for r in rows) == sac.last_step.blocks
    finally:
        sac.close()


def test_str_is_one_short_line_and_repr_has_every_field(tapesac) -> None:
    st = _run(tapesac, "full")
    text = str(st)
    assert "\n" not in text and len(text) < 300, text
    assert "step 1" in text and "policy full" in text and "dropped" in text
    assert str(st.blocks[0]).startswith("BlockStats(blocks.0:")
    assert "graph_fallback_reasons=" in repr(st)
    assert "unpacks:" in tapesac.StepStats.__doc__ and "unpacks:" in tapesac.BlockStats.__doc__


def test_print_last_step_of_two_hf_layers_is_one_line(tapesac, capsys) -> None:
    """What the README suggests, `print(sac.last_step)`, on a two-layer HF model: one line, not the dataclass repr."""
    import torch

    model = M.hf_qwen3(2)
    sac = tapesac.TapeSAC(model, blocks="model.layers.*", policy="full")
    ids = torch.randint(0, M.HF_VOCAB, (M.B, M.T))
    with sac.step():
        M.hf_loss(model, ids).backward()
    print(sac.last_step)
    print(sac.last_step.blocks[1])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(len(line) < 200 for line in lines), lines
    assert lines[0].startswith("StepStats(step 1, policy full, 2 block calls") and "peak" in lines[0], lines
    assert lines[1].startswith("BlockStats(model.layers.1: saved "), lines
    assert len(repr(sac.last_step)) > 10 * len(lines[0])  # the repr keeps every field
    sac.close()
