# tapesac.demo — train a tiny Qwen3 on Jane Austen under tapesac and show what it keeps, drops and replays.
#
# Contract:
# - `tapesac demo [options]` (cli.py; `add_arguments(parser)`, `run(args) -> int`; `main(argv)` runs it through the
#   CLI, as do `python -m tapesac demo ...` and `python -m tapesac.demo ...`): builds
#   tiny_qwen3 (random weights, byte vocabulary 259) and trains it with AdamW on AustenData (five books;
#   persuasion.txt held out). When the Austen corpus is not found (and no --corpus was given) it warns on
#   stderr (the tapesac logger; the message says what the files are and where to get them) and trains on
#   Debian's licence texts (tapesac.data.license_corpus) instead; when that is missing too it fails with both
#   messages.
# - Every training step runs as
#       with sac.step(): loss = model(input_ids=x, labels=x).loss; loss.backward()
#   under tapesac.TapeSAC(model, blocks="model.layers.*", policy=--policy); the optimizer steps outside.
#   `--no-sac` trains the same way without tapesac (the baseline for step times).
# - Exactness check, before training: a deep copy of the model runs step 1's batch without tapesac; the
#   loss and every parameter gradient of step 1 under tapesac must be bitwise equal to it (CPU). On a
#   mismatch main() raises ExactnessError naming the first differing tensor; it never trains on silently.
# - Output: a header (versions, threads, model size, corpus, policy), one line per step (loss, step time
#   including the optimizer, kept/dropped MiB, ops recorded/replayed from sac.last_step), validation
#   loss / perplexity / bits per byte on persuasion before and after training (torch.no_grad, no tapesac),
#   a summary (the median step: forward and backward, the `with sac.step()` block, over steps 2.. —
#   report.median_of_steps, the figure `tapesac report` prints for the same run's log; first vs last loss)
#   and sac.report().pretty().
#   `--json PATH` writes the same numbers, with the environment, as JSON.
# - Deterministic: --seed fixes the weights and the batch stream; the global RNG is seeded with it too.
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from tapesac.data import AustenData, CorpusNotFoundError, TextData, license_corpus
from tapesac.log import logger
from tapesac.models import param_count, tiny_qwen3

__all__ = ["ExactnessError", "add_arguments", "build_parser", "main", "run"]

DESCRIPTION = "Train a tiny Qwen3 on Jane Austen (byte-level) under tapesac selective checkpointing."

MiB = 1024.0 * 1024.0


class ExactnessError(AssertionError):
    """Loss or a gradient under tapesac differs from the run without it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tapesac demo", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    p.add_argument(
        "--policy",
        default="full",
        help='tapesac policy: "none" | "full" | "auto" | comma-separated op names to save, '
        'e.g. "aten::mm,aten::_scaled_dot_product_flash_attention_for_cpu" (default "full")',
    )
    p.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    p.add_argument("--seq", type=int, default=128, help="bytes per sequence (default 128)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers = checkpointed blocks (default 4)")
    p.add_argument("--hidden", type=int, default=192, help="model width (default 192)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden // 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches from persuasion (default 8)")
    p.add_argument("--corpus", default=None, help="Austen directory (default: <repo>/../shared/data/austen)")
    p.add_argument("--no-sac", action="store_true", help="train without tapesac (baseline step times)")
    p.add_argument("--no-check", action="store_true", help="skip the bitwise exactness check")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--memory-limit", default=None, help='step-peak limit for policy "auto", e.g. "40MiB" or "90%%"')
    p.add_argument("--log", default=None, metavar="PATH", help="append tapesac's per-step telemetry (JSON lines)")
    p.add_argument("--plot", default=None, metavar="PATH", help="write the last step's memory plot (PNG)")


def _parse_policy(text: str) -> Any:
    """A policy string, or a comma-separated list of op names -> frozenset (ops to save)."""
    if "," in text or "::" in text or "." in text:
        names = frozenset(t.strip() for t in text.split(",") if t.strip())
        if not names:
            raise SystemExit(f"--policy: expected a policy name or op names, got {text!r}")
        return names
    return text


def _load_data(args: argparse.Namespace) -> TextData:
    try:
        return AustenData(args.corpus, seq_len=args.seq, batch_size=args.batch, seed=args.seed)
    except CorpusNotFoundError as austen_err:
        if args.corpus is not None:
            raise  # an explicit --corpus that is wrong is an error, not a reason to train on something else
        try:
            data = license_corpus(seq_len=args.seq, batch_size=args.batch, seed=args.seed)
        except CorpusNotFoundError as fallback_err:
            raise CorpusNotFoundError(f"{austen_err}\nand the fallback failed too: {fallback_err}") from None
        logger.warning(f"tapesac demo: {austen_err}\nFalling back to the licence texts in {data.source} (Debian "
                       f"base-files); losses are not comparable with Austen runs.")
        return data


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bitwise comparison (-0.0 != 0.0, NaN payloads count)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _reference_step(ref: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Loss and named gradients of one step of `ref` (a deep copy of the model) without tapesac."""
    ref.zero_grad(set_to_none=True)
    loss = ref(input_ids=x, labels=x).loss
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in ref.named_parameters()}
    return loss.detach().clone(), grads


def _check_exact(model: torch.nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor,
                 ref_grads: dict[str, torch.Tensor | None]) -> int:
    if not _bitwise_equal(loss.detach(), ref_loss):
        raise ExactnessError(
            f"exactness check failed: loss under tapesac {loss.item()!r} != {ref_loss.item()!r} without it "
            "(expected bitwise equal on CPU). This is a tapesac bug: rerun with --policy none to see whether "
            "recording alone changes it, and report the model and policy."
        )
    got = dict(model.named_parameters())
    if set(got) != set(ref_grads):
        raise ExactnessError(
            f"exactness check failed: parameter names differ from the deep copy; only under tapesac: "
            f"{sorted(set(got) - set(ref_grads))[:5]}, only without: {sorted(set(ref_grads) - set(got))[:5]}"
        )
    n = 0
    for name, p in got.items():
        ref = ref_grads[name]
        if not _bitwise_equal(p.grad, ref):
            detail = "one of them is None"
            if p.grad is not None and ref is not None and p.grad.shape == ref.shape:
                diff = (p.grad.double() - ref.double()).abs()
                detail = f"max |diff| {diff.max().item():.3e}, {int((diff > 0).sum())} of {diff.numel()} elements differ"
            raise ExactnessError(
                f"exactness check failed: gradient of {name} under tapesac differs from the run without it "
                f"({detail}); expected bitwise equal on CPU. This is a tapesac bug: report the model and policy."
            )
        n += p.grad is not None
    return n


@torch.no_grad()
def _validate(model: torch.nn.Module, batches: Sequence[torch.Tensor]) -> dict[str, float]:
    was_training = model.training
    model.eval()
    try:
        losses = [float(model(input_ids=x, labels=x).loss) for x in batches]
    finally:
        model.train(was_training)
    mean = statistics.fmean(losses) if losses else float("nan")
    return {"loss": mean, "perplexity": math.exp(mean), "bits_per_byte": mean / math.log(2), "batches": len(losses)}


def _environment() -> dict[str, Any]:
    """The benchmarks' environment record (versions, CPU, threads) with the provenance of the tapesac that ran."""
    from tapesac.bench.harness import environment

    return environment()


def main(argv: Sequence[str] | None = None) -> int:
    """``tapesac demo argv...`` (one-line errors; see tapesac.cli)."""
    from tapesac.cli import run_module

    return run_module("demo", argv)


def _heads(args: argparse.Namespace) -> int:
    """The attention heads, after the numeric options are checked (a bad value is a usage error, cli_args)."""
    from .cli_args import at_least, positive_finite, writable

    writable("--plot", args.plot, figure=True)
    writable("--json", args.json)  # before training: it was written at the end (an adversarial test: a folder failed
    # there, after the whole run, with a raw OSError)
    outputs = [(o, v) for o, v in (("--json", args.json), ("--log", args.log), ("--plot", args.plot)) if v]
    for k, (o1, v1) in enumerate(outputs):
        for o2, v2 in outputs[k + 1:]:
            if Path(v1).resolve() == Path(v2).resolve():  # --json overwrote the --log telemetry (adversarial test)
                raise SystemExit(f"{o1} and {o2} name one file ({v1}); give each its own path")
    for option, value in (("--steps", args.steps), ("--batch", args.batch), ("--layers", args.layers),
                          ("--hidden", args.hidden), ("--heads", args.heads), ("--threads", args.threads)):
        at_least(option, value, 1)
    at_least("--seq", args.seq, 2)  # a byte and the next one it predicts
    at_least("--val-batches", args.val_batches, 0)
    positive_finite("--lr", args.lr)
    heads = args.heads if args.heads is not None else max(1, args.hidden // 32)
    if args.hidden % heads:
        raise SystemExit(f"--heads {heads} must divide --hidden {args.hidden}")
    return heads


def run(args: argparse.Namespace) -> int:
    heads = _heads(args)
    kv_heads = 2 if heads % 2 == 0 else 1
    policy = _parse_policy(args.policy)

    import tapesac
    from tapesac.report import median_of_steps

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = _load_data(args)  # CorpusNotFoundError: a user error (one line, exit status 2)
    model = tiny_qwen3(
        vocab_size=data.vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=args.hidden // heads,
        max_position_embeddings=max(1024, args.seq),
        seed=args.seed,
    )
    # The reference copy is taken before TapeSAC sees the model, so nothing of tapesac can be copied along.
    ref_model = copy.deepcopy(model) if not (args.no_sac or args.no_check) else None
    sac = None if args.no_sac else tapesac.TapeSAC(
        model, blocks="model.layers.*", policy=policy, memory_limit=args.memory_limit, log=args.log)
    env = _environment()
    policy_text = "off (--no-sac)" if args.no_sac else (
        ",".join(sorted(policy)) if isinstance(policy, frozenset) else str(policy))
    print(f"tapesac demo: torch {env['torch']} (transformers {env['transformers']}, {env['threads']} threads, "
          f"{env['cpu']})")
    print(f"model: tiny Qwen3, {param_count(model):,} params, H{args.hidden} L{args.layers} heads {heads}/{kv_heads} "
          f"kv, vocab {data.vocab_size}")
    print(f"corpus: {data.describe()}")
    print(f"batch {args.batch} x seq {args.seq}, AdamW lr {args.lr}, {args.steps} steps, seed {args.seed}, "
          f"policy: {policy_text}")

    val_batches = data.val_batches(args.val_batches)
    val_before = _validate(model, val_batches)
    print(f"validation before training: loss {val_before['loss']:.4f}, perplexity {val_before['perplexity']:.2f}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = iter(data)
    records: list[dict[str, Any]] = []
    checked = None
    try:
        for step in range(1, args.steps + 1):
            x = next(batches)  # [batch, seq] int64
            ref = None
            if ref_model is not None:
                rng = torch.get_rng_state()
                ref = _reference_step(ref_model, x)
                ref_model = None
                torch.set_rng_state(rng)  # the tapesac step sees the same RNG stream (dropout, if any)
            t0 = time.perf_counter()
            if sac is None:
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                fb_ms = (time.perf_counter() - t0) * 1e3
            else:
                with sac.step():
                    loss = model(input_ids=x, labels=x).loss
                    loss.backward()
                fb_ms = sac.last_step.step_ms  # the same region, timed by tapesac
            if ref is not None:
                # Outside the timed region: the check compares before the optimizer touches anything.
                t_check = time.perf_counter()
                checked = _check_exact(model, loss, *ref)
                print(f"exactness check: loss and {checked} gradients bitwise equal")
                t0 += time.perf_counter() - t_check
            opt.step()
            opt.zero_grad(set_to_none=True)
            ms = (time.perf_counter() - t0) * 1e3
            rec: dict[str, Any] = {"step": step, "loss": loss.item(), "ms": ms, "forward_backward_ms": fb_ms}
            if sac is not None:
                st = sac.last_step
                rec.update(kept_bytes=st.kept_bytes, dropped_bytes=st.dropped_bytes, ops_recorded=st.ops_recorded,
                           ops_replayed=st.ops_replayed, replay_ms=st.replay_ms)
                print(f"step {step:4d}  loss {rec['loss']:.4f}  {ms:8.1f} ms  kept {st.kept_bytes / MiB:7.2f} MiB  "
                      f"dropped {st.dropped_bytes / MiB:7.2f} MiB  ops recorded {st.ops_recorded:6d}  "
                      f"replayed {st.ops_replayed:6d}")
            else:
                print(f"step {step:4d}  loss {rec['loss']:.4f}  {ms:8.1f} ms")
            sys.stdout.flush()
            records.append(rec)
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss became {rec['loss']} at step {step}; try a smaller --lr")

        val_after = _validate(model, val_batches)
        # The forward and backward of each step (the `with sac.step()` block): the figure and the median that
        # `tapesac report` prints for this run's --log.
        median_ms = median_of_steps([r["forward_backward_ms"] for r in records])
        first, last = records[0]["loss"], records[-1]["loss"]
        print(f"validation after training: loss {val_after['loss']:.4f}, perplexity {val_after['perplexity']:.2f}, "
              f"{val_after['bits_per_byte']:.3f} bits/byte ({val_after['batches']} batches of {data.val_label})")
        print(f"summary: median step {median_ms:.1f} ms (forward and backward; "
              f"{'steps 2.., step 1 is the warm-up' if len(records) > 1 else 'one step'}); train loss {first:.4f} -> "
              f"{last:.4f}; val loss {val_before['loss']:.4f} -> {val_after['loss']:.4f}")
        report = None
        if sac is not None:
            report = sac.report()
            print(report.pretty())
            if args.plot:
                print(f"memory plot: {report.plot(args.plot)}")
        if args.json:
            out = {
                "schema_version": 1,
                "args": vars(args),
                "environment": env,
                "model": {"params": param_count(model), "hidden": args.hidden, "layers": args.layers,
                          "heads": heads, "kv_heads": kv_heads, "vocab": data.vocab_size},
                "corpus": {"name": data.name, "source": data.source, "train_bytes": data.train_bytes,
                           "val_bytes": data.val_bytes},
                "exactness_checked_gradients": checked,
                "steps": records,
                "median_step_ms": median_ms,
                "validation_before": val_before,
                "validation_after": val_after,
                "report": report.to_dict() if report is not None else None,
            }
            path = Path(args.json)
            if path.parent != Path(""):
                path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2, default=str) + "\n")
            print(f"wrote {path}")
    finally:
        if sac is not None:
            sac.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
