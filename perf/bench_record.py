#!/usr/bin/env python3
# perf/bench_record.py — what recording a tape costs per op, on CPU, in nanoseconds.
#
# Contract:
# - Workloads (each a module whose checkpointed blocks are `blocks.*`):
#     smallops     one block of --ops tiny ops (mm/add/mul/tanh on --size x --size tensors), so kernel time is
#                  small and the per-op cost of recording dominates the difference;
#     qwen3_layer  one tiny Qwen3 decoder layer (tapesac.models.tiny_qwen3, H128) on a short sequence;
#     blocks       --blocks blocks of (mm, tanh) on --size x --size tensors (not in the default list): the cost per
#                  block call (module hooks, the block call, its statistics) dominates.
# - Variants, forward only, autograd on (parameters require grad), each on its own deep copy of the module:
#     plain        no tapesac;
#     rec_only     inside tapesac.record_ops(...): the C++ recorder alone (no saved-tensor hooks, nothing
#                  dropped; the op names are also turned into a Python list once per forward);
#     sac_none     inside `with sac.step()` under TapeSAC(policy="none"): the recorder runs and the pack hooks
#                  keep everything; the step exits without backward (the API allows it);
#     sac_full     the same with policy="full" (records and also drops, then frees at step exit);
#     sac_none_pyhooks, sac_full_pyhooks  the same through autograd's Python saved-tensor hooks (Note [Saved tensors
#                  without Python] off for their forwards): both paths side by side in one run;
#     py_hooks     identity Python saved-tensor hooks: the floor of any pack/unpack hook called from autograd;
#     py_mode      a do-nothing Python TorchDispatchMode: the cost tapesac avoids by recording in C++.
# - Validation before timing: every variant's output is bitwise equal to plain's.
# - Timing: warm-up rounds, then interleaved rounds (the variant order rotates each round); one sample = the
#   mean time of `inner` forwards (calibrated so a plain sample lasts >= --min-sample-ms); gc disabled while
#   timing; one intra-op thread by default (--threads).
# - Reported: median and IQR per variant (us per forward); ops per forward (recorded by sac_none:
#   sac.last_step.ops_recorded, cross-checked with len(tapesac.record_ops(...))); overhead per op = median
#   over rounds of (t_variant - t_plain) / ops with its IQR, in ns/op; the difference of the minima per op
#   (robust when other processes add noise); the fixed cost of an empty `with sac.step(): pass`, and the
#   net ns/op with that fixed cost subtracted.
# - `--json PATH` writes all numbers with the environment (tapesac.bench.harness.environment: provenance, torch,
#   CPU model, threads, date);
#   `--smoke` runs few rounds (< 20 s). Exit status 1 when a variant fails validation.
# - `--recorder-hook`: the recorder's hook for every variant (auto / dispatch_key / record_function), to compare the
#   two hooks on one build.
# - `--saved-hooks`: how autograd saves under tapesac's hooks for every variant: `cpp` (default, Note [Saved tensors
#   without Python] in python/bindings/saved_hooks.cpp) or `python` (autograd's Python saved-tensor hooks calling
#   tapesac's C functions), to compare the two on one build.
# - `--instructions`: instead of time, instructions per forward counted by valgrind's callgrind (deterministic on a
#   shared machine). One child process per workload runs under `valgrind --tool=callgrind --instr-atstart=no`;
#   it switches instrumentation on around `--forwards` forwards of each variant and dumps the counts after each,
#   through callgrind's client requests (a 2-function C shim compiled at run time from valgrind/callgrind.h);
#   an empty region (no forward) measured the same way is subtracted. Reported per variant: instructions per
#   forward, x plain, and the overhead in instructions per recorded op. Needs valgrind, its header and cc.
from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils._python_dispatch
from torch import nn

REPO = Path(__file__).resolve().parents[1]

try:
    import tapesac
except ImportError:
    # Running from a source checkout whose extension was built in place.
    sys.path.insert(0, str(REPO / "python"))
    try:
        import tapesac
    except ImportError as e:
        raise SystemExit(
            f"bench_record: cannot import tapesac ({e}); expected the package installed "
            "(e.g. `pip install -e .` at the repository root) or built in place under python/"
        ) from None
from tapesac.bench import harness  # noqa: E402
from tapesac.bench.measure import bits_equal  # noqa: E402


class SmallOps(nn.Module):
    """One block of `n_ops` ops on [size, size] tensors: repeated (mm, add, tanh, mul)."""

    def __init__(self, n_ops: int, size: int) -> None:
        super().__init__()
        self.groups = max(1, n_ops // 4)
        self.w = nn.Parameter(torch.randn(size, size) / size**0.5)
        self.b = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [size, size]
        h = x
        for _ in range(self.groups):
            h = torch.tanh(h @ self.w + self.b) * 0.5  # mm, add, tanh, mul
        return h


class MmTanh(nn.Module):
    """One block of two ops: tanh(x @ w)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(size, size) / size**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


class ManyBlocks(nn.Module):
    """`n` blocks of MmTanh under `blocks`: the per-block-call cost (hooks, block call, statistics) dominates."""

    def __init__(self, n: int, size: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MmTanh(size) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Stack(nn.Module):
    """Holds the checkpointed block(s) under `blocks` and calls them with fixed extra arguments."""

    def __init__(self, block: nn.Module, **call_kwargs: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block])
        self.call_kwargs = call_kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, **self.call_kwargs)
        return x


def build_workload(name: str, args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, str]:
    """(module, input, description). The input does not require grad; parameters do."""
    g = torch.Generator().manual_seed(0)
    if name == "smallops":
        torch.manual_seed(0)
        mod = Stack(SmallOps(args.ops, args.size))
        x = torch.randn(args.size, args.size, generator=g)
        return mod, x, f"{mod.blocks[0].groups} x (mm, add, tanh, mul) on {args.size}x{args.size} fp32"
    if name == "qwen3_layer":
        from tapesac.models import tiny_qwen3

        model = tiny_qwen3(hidden_size=args.hidden, num_hidden_layers=1, seed=0)
        layer = model.model.layers[0]
        x = torch.randn(args.batch, args.seq, args.hidden, generator=g)  # [batch, seq, H]
        position_ids = torch.arange(args.seq).unsqueeze(0)  # [1, seq]
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(x, position_ids)  # [1, seq, head_dim] each
        mod = Stack(layer, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
        return mod, x, f"Qwen3DecoderLayer H{args.hidden}, batch {args.batch} x seq {args.seq} fp32, sdpa"
    if name == "blocks":
        torch.manual_seed(0)
        mod = ManyBlocks(args.blocks, args.size)
        x = torch.randn(args.size, args.size, generator=g)
        return mod, x, f"{args.blocks} blocks of (mm, tanh) on {args.size}x{args.size} fp32"
    raise SystemExit(f"unknown workload {name!r}; expected one of smallops, qwen3_layer, blocks")


class _DropMessages(logging.Filter):
    """Drops the log records whose message contains `text`."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class _CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Reference cost: a Python dispatch mode that only counts and forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def make_variants(mod: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> {"fn": zero-arg callable running one forward, "sac": TapeSAC or None, "mod": module}."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        m = copy.deepcopy(mod)
        if name == "plain":
            out[name] = {"fn": (lambda m=m: m(x)), "sac": None, "mod": m}
        elif name in ("sac_none", "sac_full"):
            sac = tapesac.TapeSAC(m, blocks="blocks.*", policy=name[4:])

            def fn(m=m, sac=sac):
                with sac.step():
                    y = m(x)
                return y

            out[name] = {"fn": fn, "sac": sac, "mod": m}
        elif name in ("sac_none_pyhooks", "sac_full_pyhooks"):
            sac = tapesac.TapeSAC(m, blocks="blocks.*", policy=name.split("_")[1])

            def fn(m=m, sac=sac):
                was = tapesac._C.saved_hooks_in_cpp()
                tapesac._C.set_saved_hooks_in_cpp(False)
                try:
                    with sac.step():
                        y = m(x)
                finally:
                    tapesac._C.set_saved_hooks_in_cpp(was)
                return y

            out[name] = {"fn": fn, "sac": sac, "mod": m}
        elif name == "rec_only":

            def fn(m=m):
                out = []
                tapesac.record_ops(lambda: out.append(m(x)))
                return out[0]

            out[name] = {"fn": fn, "sac": None, "mod": m}
        elif name == "py_hooks":

            def fn(m=m):
                with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                    return m(x)

            out[name] = {"fn": fn, "sac": None, "mod": m}
        elif name == "py_mode":
            mode = _CountingMode()

            def fn(m=m, mode=mode):
                with mode:
                    return m(x)

            out[name] = {"fn": fn, "sac": None, "mod": m, "mode": mode}
        else:
            raise SystemExit(f"unknown variant {name!r}; expected plain, rec_only, sac_none, sac_full, "
                             "sac_none_pyhooks, sac_full_pyhooks, py_hooks, py_mode")
    return out


def validate_variants(variants: dict[str, dict[str, Any]], errors: dict[str, str]) -> None:
    """Runs every variant once (warming its code paths) and drops, reporting it in `errors`, one that raises or whose
    output is not bitwise equal to plain's."""
    ref = variants["plain"]["fn"]()
    for vname, v in list(variants.items()):
        try:
            y = v["fn"]()
        except Exception as e:  # report and go on with the other variants
            errors[vname] = f"{type(e).__name__}: {e}"
            del variants[vname]
            continue
        if not bits_equal(y, ref):
            errors[vname] = "output differs from plain (expected bitwise equal)"
            del variants[vname]


def count_ops(variants: dict[str, dict[str, Any]], x: torch.Tensor, errors: dict[str, str]) -> dict[str, int]:
    """Ops per forward as tapesac sees them (sac_none's last step, record_ops) and as a Python dispatch mode does;
    a mismatch between the first two is reported in `errors`."""
    ops = {}
    if "sac_none" in variants:
        st = variants["sac_none"]["sac"].last_step
        ops["sac_ops_recorded"] = int(st.ops_recorded)
        ops["sac_block_calls"] = int(st.block_calls)
        ops["sac_saved_tensors"] = int(st.saved_tensors)
    try:
        ops["record_ops"] = len(tapesac.record_ops(variants["plain"]["mod"], x))
    except Exception as e:
        errors["record_ops"] = f"{type(e).__name__}: {e}"
    if "py_mode" in variants:
        mode = variants["py_mode"]["mode"]
        mode.count = 0
        variants["py_mode"]["fn"]()
        ops["py_mode_ops"] = mode.count
    if ops.get("sac_ops_recorded") is not None and ops.get("record_ops") is not None \
            and ops["sac_ops_recorded"] != ops["record_ops"]:
        errors["op_count"] = (f"sac.last_step.ops_recorded={ops['sac_ops_recorded']} != "
                              f"len(record_ops)={ops['record_ops']} for the same forward")
    return ops


def bench_workload(name: str, args: argparse.Namespace) -> dict[str, Any]:
    mod, x, desc = build_workload(name, args)
    variants = make_variants(mod, x, args.variants)
    res: dict[str, Any] = {"workload": name, "description": desc, "variants": {}, "errors": {}}
    # Validate (and warm the code paths once) before timing; a failing variant is reported and not timed.
    validate_variants(variants, res["errors"])
    ops = res["ops"] = count_ops(variants, x, res["errors"])
    n_ops = ops.get("sac_ops_recorded") or ops.get("record_ops")

    # Calibrate `inner` on plain, warmed up, so one sample lasts >= min_sample_ms (the quickest of 3 tries:
    # a busy machine must not shrink it).
    for v in variants.values():
        for _ in range(3):
            v["fn"]()
    plain = variants["plain"]["fn"]
    inner = 1
    while min(harness.timed(plain, inner) for _ in range(3)) * inner < args.min_sample_ms * 1e-3 and inner < 1 << 20:
        inner *= 2
    res["inner"] = inner

    names = list(variants)
    empty_steps: dict[str, list[float]] = {}
    # An empty step records no block call by design: its warning says nothing here.
    no_block_call = _DropMessages("recorded no block call")
    logging.getLogger("tapesac").addFilter(no_block_call)
    try:
        for n in names:
            sac = variants[n]["sac"]
            if sac is not None:
                def empty(sac=sac):
                    with sac.step():
                        pass
                empty_steps[n] = [harness.timed(empty, 200) for _ in range(5)]
    finally:
        logging.getLogger("tapesac").removeFilter(no_block_call)
    samples = harness.interleaved_rounds(names, lambda n: harness.timed(variants[n]["fn"], inner),
                                         rounds=args.rounds, warmup=args.warmup)

    for n in names:
        v = {"us_per_forward": harness.stats(samples[n], scale=1e6)}
        if n != "plain":
            denom = ops["py_mode_ops"] if n == "py_mode" else n_ops
            if denom:
                per_op = [(t - p) / denom * 1e9 for t, p in zip(samples[n], samples["plain"])]  # paired by round
                v["overhead_ns_per_op"] = harness.stats(per_op)
                # Noise from other processes only adds time, so the difference of minima is a robust second view.
                v["overhead_ns_per_op_min"] = (min(samples[n]) - min(samples["plain"])) / denom * 1e9
                v["ops_denominator"] = denom
                if n in empty_steps:
                    fixed = statistics.median(empty_steps[n])
                    v["empty_step_us"] = fixed * 1e6
                    v["net_overhead_ns_per_op"] = v["overhead_ns_per_op"]["median"] - fixed / denom * 1e9
            v["ratio_to_plain"] = statistics.median(samples[n]) / statistics.median(samples["plain"])
        res["variants"][n] = v
    for v in variants.values():
        if v["sac"] is not None:
            v["sac"].close()
    return res


def print_table(results: list[dict[str, Any]]) -> None:
    for res in results:
        ops = res["ops"]
        print(f"\n{res['workload']}: {res['description']}; ops/forward: tapesac recorded "
              f"{ops.get('sac_ops_recorded', '?')} (saving {ops.get('sac_saved_tensors', '?')} tensors), record_ops "
              f"{ops.get('record_ops', '?')}, "
              f"python dispatch mode {ops.get('py_mode_ops', '?')}; {res['inner']} forwards per sample")
        print(f"  {'variant':<10} {'us/forward':>11} {'IQR':>9} {'x plain':>8} {'overhead ns/op':>15} {'IQR':>9} "
              f"{'min-based':>10} {'ops':>6} {'empty step us':>14} {'net ns/op':>10}")
        for n, v in res["variants"].items():
            t = v["us_per_forward"]
            line = f"  {n:<10} {t['median']:11.2f} {t['iqr']:9.2f}"
            if "ratio_to_plain" in v:
                line += f" {v['ratio_to_plain']:8.3f}"
            if "overhead_ns_per_op" in v:
                o = v["overhead_ns_per_op"]
                line += (f" {o['median']:15.1f} {o['iqr']:9.1f} {v['overhead_ns_per_op_min']:10.1f}"
                         f" {v['ops_denominator']:6d}")
            if "empty_step_us" in v:
                line += f" {v['empty_step_us']:14.2f} {v['net_overhead_ns_per_op']:10.1f}"
            print(line)
        for k, e in res["errors"].items():
            print(f"  ERROR {k}: {e}")


_CALLGRIND_SHIM = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop_and_dump(const char* name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _callgrind_shim(tmp: str) -> Any:
    """callgrind's client requests (synchronous, unlike callgrind_control) through a 2-function C library built
    here with the system compiler from valgrind's header."""
    import ctypes
    import subprocess

    src, lib = Path(tmp) / "cg_shim.c", Path(tmp) / "cg_shim.so"
    src.write_text(_CALLGRIND_SHIM)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    shim = ctypes.CDLL(str(lib))
    shim.cg_stop_and_dump.argtypes = [ctypes.c_char_p]
    return shim


def instructions_child(args: argparse.Namespace) -> int:
    """Runs under callgrind (--instr-atstart=no): one dump per region, in the order written to args.child_out."""
    mod, x, desc = build_workload(args.instructions_child, args)
    variants = make_variants(mod, x, args.variants)
    ref = variants["plain"]["fn"]()
    for name, v in variants.items():
        if not bits_equal(v["fn"](), ref):
            raise SystemExit(f"bench_record: variant {name} differs from plain (expected bitwise equal)")
        for _ in range(3):
            v["fn"]()
    ops = len(tapesac.record_ops(variants["plain"]["mod"], x))
    shim = _callgrind_shim(str(Path(args.child_out).parent))
    regions = ["(empty)"] + list(variants)
    for name in regions:
        fn = variants[name]["fn"] if name in variants else None
        n = args.forwards if fn is not None else 0
        shim.cg_start()
        for _ in range(n):
            fn()
        shim.cg_stop_and_dump(name.encode())
    for v in variants.values():
        if v["sac"] is not None:
            v["sac"].close()
    Path(args.child_out).write_text(json.dumps({"regions": regions, "ops": ops, "description": desc}))
    return 0


def _dump_totals(prefix: Path) -> list[int]:
    """Ir totals of callgrind's numbered dumps prefix.1, prefix.2, ... in order."""
    parts = sorted(prefix.parent.glob(prefix.name + ".*"), key=lambda q: int(q.suffix[1:]))
    totals = []
    for q in parts:
        for line in q.read_text(errors="replace").splitlines():
            if line.startswith("summary:"):
                totals.append(int(line.split()[1]))
                break
    return totals


def bench_instructions(workload: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import shutil
    import subprocess
    import tempfile

    if shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        raise SystemExit("bench_record --instructions needs valgrind and its header valgrind/callgrind.h "
                         "(Debian: apt-get install valgrind) and a C compiler (cc)")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "cg.out"
        child_out = Path(tmp) / "child.json"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={prefix}",
               sys.executable, str(Path(__file__).resolve()), *argv, "--instructions-child", workload,
               "--child-out", str(child_out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not child_out.exists():
            raise SystemExit(f"bench_record: the callgrind child failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
        info = json.loads(child_out.read_text())
        totals = _dump_totals(prefix)
    regions = info["regions"]
    if len(totals) < len(regions):
        raise SystemExit(f"bench_record: expected {len(regions)} callgrind dumps, found {len(totals)}")
    base = totals[0]
    per_fwd = {n: (t - base) / args.forwards for n, t in zip(regions[1:], totals[1:len(regions)])}
    ops = info["ops"]
    res: dict[str, Any] = {"workload": workload, "description": info["description"], "ops_per_forward": ops,
                           "forwards": args.forwards, "empty_region_instructions": base, "variants": {}}
    for n, ir in per_fwd.items():
        v = {"instructions_per_forward": ir, "ratio_to_plain": ir / per_fwd["plain"]}
        if n != "plain":
            v["overhead_instructions_per_op"] = (ir - per_fwd["plain"]) / ops
        res["variants"][n] = v
    return res


def print_instructions(results: list[dict[str, Any]]) -> None:
    for res in results:
        print(f"\n{res['workload']}: {res['description']}; {res['ops_per_forward']} recorded ops per forward; "
              f"{res['forwards']} forwards per variant under callgrind")
        print(f"  {'variant':<10} {'instr/forward':>14} {'x plain':>8} {'overhead instr/op':>18}")
        for n, v in res["variants"].items():
            over = v.get("overhead_instructions_per_op")
            print(f"  {n:<10} {v['instructions_per_forward']:14,.0f} {v['ratio_to_plain']:8.3f}"
                  + (f" {over:18,.0f}" if over is not None else ""))


def write_json(args: argparse.Namespace, benchmark: str, env: dict[str, Any], results: list[dict[str, Any]]) -> None:
    out = {"schema_version": 1, "benchmark": benchmark, "environment": env,
           "args": {k: v for k, v in vars(args).items()}, "results": results}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


def run_instructions(args: argparse.Namespace, raw_argv: list[str], env: dict[str, Any]) -> int:
    """--instructions: one callgrind child per workload (the same arguments, without --instructions and --json)."""
    t0 = time.perf_counter()
    child_argv = [a for a in raw_argv if a not in ("--instructions",)]
    if "--json" in child_argv:
        i = child_argv.index("--json")
        del child_argv[i:i + 2]
    child_argv = [a for a in child_argv if not a.startswith("--json=")]
    print(f"bench_record --instructions: torch {env['torch']}, {harness.describe_provenance(env)}; "
          f"{args.forwards} forwards per variant")
    results = [bench_instructions(w.strip(), args, child_argv) for w in args.workloads.split(",") if w.strip()]
    print_instructions(results)
    print(f"\n(instructions counted by callgrind; overhead = (variant - plain) / recorded ops; "
          f"{time.perf_counter() - t0:.1f} s)")
    if args.json:
        write_json(args, "bench_record_instructions", env, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Per-op cost of tapesac's tape recording (CPU, forward only).")
    p.add_argument("--workloads", default="smallops,qwen3_layer",
                   help="comma-separated: smallops,qwen3_layer,blocks (--blocks blocks of 2 ops: the per-block cost)")
    p.add_argument("--blocks", type=int, default=48, help="blocks of the 'blocks' workload")
    p.add_argument("--variants", default="plain,rec_only,sac_none,sac_full,py_hooks,py_mode",
                   help="comma-separated, plain first: plain,rec_only,sac_none,sac_full,sac_none_pyhooks,"
                        "sac_full_pyhooks,py_hooks,py_mode")
    p.add_argument("--ops", type=int, default=200, help="smallops: ops per forward (default 200)")
    p.add_argument("--size", type=int, default=8, help="smallops: tensor side (default 8)")
    p.add_argument("--hidden", type=int, default=128, help="qwen3_layer: width (default 128)")
    p.add_argument("--batch", type=int, default=2, help="qwen3_layer: batch (default 2)")
    p.add_argument("--seq", type=int, default=32, help="qwen3_layer: sequence length (default 32)")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up rounds (default 5)")
    p.add_argument("--min-sample-ms", type=float, default=20.0, help="shortest plain sample (default 20 ms)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: OpenMP barriers on a busy machine add ms of noise; "
                        "0 keeps torch's default)")
    p.add_argument("--smoke", action="store_true", help="few rounds, for CI (< 20 s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write results and environment as JSON")
    p.add_argument("--instructions", action="store_true",
                   help="count instructions per forward under valgrind's callgrind instead of timing")
    p.add_argument("--forwards", type=int, default=10, help="--instructions: forwards per variant (default 10)")
    p.add_argument("--recorder-hook", default="auto", choices=["auto", "dispatch_key", "record_function"],
                   help="how the recorder sees operator calls (Note [Dispatch hook]; default auto: the dispatch hook)")
    p.add_argument("--saved-hooks", default="cpp", choices=["cpp", "python"],
                   help="how autograd saves under tapesac's hooks (Note [Saved tensors without Python]; default cpp)")
    p.add_argument("--instructions-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or args.variants[0] != "plain":
        args.variants = ["plain"] + [v for v in args.variants if v != "plain"]
    if args.smoke:
        args.rounds, args.warmup, args.min_sample_ms = min(args.rounds, 5), min(args.warmup, 1), min(args.min_sample_ms, 3.0)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    tapesac._C.set_recorder_hook(args.recorder_hook)
    tapesac._C.set_saved_hooks_in_cpp(args.saved_hooks == "cpp")
    if args.instructions_child:
        return instructions_child(args)

    env = harness.environment()
    if args.instructions:
        return run_instructions(args, raw_argv, env)
    print(f"bench_record: torch {env['torch']}, {env['threads']} threads, {env['cpu']}, "
          f"{harness.describe_provenance(env)}; {args.rounds} rounds after {args.warmup} warm-up")
    t0 = time.perf_counter()
    results = [bench_workload(w.strip(), args) for w in args.workloads.split(",") if w.strip()]
    print_table(results)
    print(f"\n(overhead = median over rounds of (t_variant - t_plain) / ops, IQR over rounds; min-based = "
          f"(min t_variant - min t_plain) / ops; net = overhead - empty step / ops; "
          f"{time.perf_counter() - t0:.1f} s)")
    if args.json:
        write_json(args, "bench_record", env, results)
    bad = [k for r in results for k in r["errors"] if k not in ("record_ops",)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
