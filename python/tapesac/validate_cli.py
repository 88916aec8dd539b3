"""``tapesac validate``: one training step of a model with and without tapesac, from the same state, compared
(``tapesac.validate``): loss, every gradient and every buffer bitwise, and every replayed value's record. The models
are the benchmark's (freshly initialised HF Qwen3 / Qwen3-MoE / Llama from a config, nothing downloaded) on a batch
of random token ids. Exit status 0 when everything is bitwise equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["add_arguments", "run", "main"]

DESCRIPTION = __doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .bench.sizes import ARCHS, SIZES
    from .config import CONTRACTS

    p.add_argument("--model", default="qwen3", choices=list(ARCHS), help="architecture (default qwen3)")
    p.add_argument("--size", default="smoke", choices=list(SIZES), help="the benchmark's size (default smoke)")
    p.add_argument("--policy", default="full",
                   help='tapesac policy: "none" | "full" | "auto" (its first step runs "full" while measuring) | '
                        'comma-separated op names to keep (default "full")')
    p.add_argument("--memory-limit", default=None, help='step-peak limit, e.g. "40MiB" or "90%%"')
    p.add_argument("--contract", default="check", choices=list(CONTRACTS), help="replay contract (default check)")
    p.add_argument("--seed", type=int, default=0, help="weights and batch seed (default 0)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the comparison as JSON")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from .bench.sizes import SIZES, build_model, describe_model
    from .validate import validate

    from .cli_args import writable

    writable("--json", args.json)
    size = SIZES[args.size]
    if size.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--size {args.size} needs CUDA (torch.cuda.is_available() is False); use smoke, small or "
                         f"medium")
    policy = args.policy
    if "," in policy or "::" in policy:
        policy = frozenset(t.strip() for t in policy.split(",") if t.strip())
    model = build_model(args.model, size, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (size.batch, size.seq), generator=gen).to(size.device)
    print(f"tapesac validate: {describe_model(args.model, model)}; batch {size.batch} x seq {size.seq}, "
          f"{size.dtype}, {size.device}; policy {args.policy}")

    def step(m: torch.nn.Module) -> torch.Tensor:
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    report = validate(model, step, blocks="model.layers.*", policy=policy, memory_limit=args.memory_limit,
                      contract=args.contract)
    print(report.pretty())
    if args.policy == "auto":  # an adversarial test: the output read as a check of auto's plans
        print("note: validate runs one step, and policy auto's first step measures with the masks of \"full\": this "
              "checked \"full\", no plan of auto (the test suite's random programs check planned steps)")
    if args.json:
        Path(args.json).write_text(json.dumps(dataclasses.asdict(report) | {"bitwise_equal": report.bitwise_equal},
                                              indent=2, default=str) + "\n")
        print(f"json: {args.json}")
    return 0 if report.bitwise_equal else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``tapesac validate argv...`` (one-line errors; see tapesac.cli)."""
    from .cli import run_module

    return run_module("validate", argv)
