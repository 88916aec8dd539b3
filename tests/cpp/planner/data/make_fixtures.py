"""Writes the planning problems of real block tapes as fixtures for tests/cpp/planner/test_real_tapes.cpp.

Each fixture is one block call's problem (planner text format, op costs = the measured forward times of the run
that wrote it) from: a tiny HF Qwen3 and Llama decoder layer (hidden 64) and the toy blocks of the Python test
suite. Regenerate with `python tests/cpp/planner/data/make_fixtures.py` (the exact costs differ per run; the
test compares the heuristic with the exact solver on whatever costs the file holds).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "python"))

import torch  # noqa: E402

import tapesac  # noqa: E402
import models as M  # noqa: E402  (tests/python/models.py)
from tapesac.models import tiny_llama, tiny_qwen3  # noqa: E402


def dump(name: str, model: torch.nn.Module, blocks, run) -> None:
    sac = tapesac.TapeSAC(model, blocks=blocks, memory_limit=1 << 40)
    for _ in range(3):
        with sac.step():
            run()
        model.zero_grad(set_to_none=True)
    text = sac._planner.dump_problem(0)
    (HERE / f"{name}.plan").write_text(text)
    sac.close()
    print(f"{name}: {len(text.splitlines())} lines")


def main() -> None:
    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    for name, make in (("qwen3_layer", tiny_qwen3), ("llama_layer", tiny_llama)):
        model = make(**small)
        x = torch.randint(0, 259, (2, 32))
        dump(name, model, "model.layers.*", lambda m=model, x=x: m(input_ids=x, labels=x).loss.backward())
    for name, block in (("mlp_block", M.MLPBlock()), ("attention_block", M.AttentionBlock()),
                        ("dropout_block", M.DropoutBlock()), ("inplace_block", M.InplaceBlock()),
                        ("view_block", M.ViewBlock()), ("multi_output_block", M.MultiOutputBlock())):
        model = M.Stack([block])
        x = torch.randn(M.B, M.T, M.D)
        dump(name, model, "blocks.*", lambda m=model, x=x: m(x).square().mean().backward())


if __name__ == "__main__":
    main()
