#!/usr/bin/env bash
# perf/gpu_check.sh — the one prepared GPU check, unattended on a bare H200 of the device tool (Python 3.12,
# torch 2.11.0+cu130, nvcc 13.0, CMake, ninja, pybind11, pytest, transformers; no GoogleTest, no network).
#
# Stages, each under its own time limit (a failure does not stop the later ones, so one run yields all it can):
#   build    CMake + ninja, only the targets the check runs: the _C extension (copied into python/tapesac, imported
#            from the source tree) and tapesac_test_cuda, with GoogleTest built from third_party/googletest (the
#            installed one is hidden from CMake, so this machine's build is the H200's build)          170 s
#   cpp_gpu  tapesac_test_cuda in one process (every CUDA case, one context and one CUPTI claim)         25 s
#   py_gpu   the gpu-marked pytest cases (profiler tests last: tests/python/conftest.py)                   55 s
#   suite    perf/gpu_figures.py suite: Qwen3 ~1B, bf16, seq 4096, batch 1 — nockpt, ckpt, PyTorch SAC,
#            tapesac full eager / full cuda_graph / auto at the halfway limit, validated, then timed    80 s
#   compile  perf/gpu_figures.py compile: torch.compile, activation_memory_budget=0.5 (no figure if it
#            does not compile within the limit)                                                         25 s
#   extras   perf/gpu_figures.py extras: launch-bound graph vs eager replay, CUPTI per-op launch times
#            and the planner's op-time source, the ~1B forward alone under sac.step() vs plain          40 s
# The limits add up to 415 s (under 7 minutes with the start-up; the device tool gives a task 15 minutes in all,
# so a rerun fits). Files under $OUT (at most 8): environment.txt, summary.txt, build.log, cpp_gpu.log,
# py_gpu.log, figures.log, figures.json. Exit status: non-zero when the build or a test stage failed.
#
#     OUT=/some/dir bash perf/gpu_check.sh            # device tool: $OUT is set and copied back
#     GPU_CHECK_DRY_RUN=1 bash perf/gpu_check.sh      # the CPU rehearsal: the same build and stages, the GPU cases
#                                                     # skip, the figures at CPU sizes; limits x GPU_CHECK_SCALE (20)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
DRY="${GPU_CHECK_DRY_RUN:-0}"
SCALE=1
[ "$DRY" = 1 ] && SCALE="${GPU_CHECK_SCALE:-20}"
BUILD_DIR="${GPU_CHECK_BUILD_DIR:-build/gpu}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
status=0

# name limit (seconds): the stages, in order. Keep the sum under 420 (checked below).
LIMITS="build:200 cpp_gpu:20 py_gpu:50 suite:80 compile:25 extras:40"
total=0; for s in $LIMITS; do total=$((total + ${s#*:})); done
if [ "$total" -ge 420 ]; then echo "gpu_check: the stage limits sum to ${total}s (>= 420)" >&2; exit 2; fi
limit() { for s in $LIMITS; do [ "${s%%:*}" = "$1" ] && echo $(( ${s#*:} * SCALE )); done; }

# stage NAME LOG COMMAND...: runs COMMAND under NAME's limit, appending to $OUT/LOG.
stage() {
  local name=$1 log=$2 secs; shift 2
  secs=$(limit "$name")
  echo "== $name (limit ${secs}s)" | tee -a "$OUT/summary.txt"
  echo "== $name: $*" >> "$OUT/$log"
  local t0=$SECONDS
  timeout -k 5 "$secs" "$@" >> "$OUT/$log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s$([ $rc -eq 124 ] && echo ' (time limit)')" | tee -a "$OUT/summary.txt"
  return $rc
}

echo "gpu_check: dry_run=$DRY limits ${LIMITS} (sum ${total}s, x${SCALE})" > "$OUT/summary.txt"
{ date -u; nvidia-smi || echo "(no nvidia-smi)"; nvcc --version | tail -2; cmake --version | head -1
  "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
"device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'; } > "$OUT/environment.txt" 2>&1

build() {
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")" \
    -DTAPESAC_BUILD_TESTS=ON -DTAPESAC_BUILD_PYTHON=ON -DTAPESAC_VENDORED_GTEST=ON \
    -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DTAPESAC_CTEST_PER_CASE=OFF \
    -DTORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" || return 1
  local targets="_C"
  grep -qE "^build (tests/)?tapesac_test_cuda[: ]" "$BUILD_DIR/build.ninja" && targets="$targets tapesac_test_cuda"
  echo "targets: $targets"
  # shellcheck disable=SC2086
  cmake --build "$BUILD_DIR" --parallel "$JOBS" --target $targets || return 1
  cp "$BUILD_DIR"/python/_C*.so python/tapesac/
}
export -f build; export PY BUILD_DIR JOBS TORCH_CUDA_ARCH_LIST
if ! stage build build.log bash -c build; then
  echo "build failed: see build.log" | tee -a "$OUT/summary.txt"; cat "$OUT/summary.txt"; exit 1
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

# Item 8 of issue 17: every CUDA gtest in one process. Without a device the GPU cases GTEST_SKIP; the CudaHost*
# cases run everywhere.
if [ -x "$BUILD_DIR/tests/tapesac_test_cuda" ]; then
  stage cpp_gpu cpp_gpu.log "$BUILD_DIR/tests/tapesac_test_cuda" || status=1
else
  echo "== cpp_gpu: no tapesac_test_cuda (no GPU backend in this build)" | tee -a "$OUT/summary.txt"; status=1
fi
stage py_gpu py_gpu.log "$PY" -m pytest tests/python -q -p no:cacheprovider -m gpu -rfEs || status=1

FIG=(perf/gpu_figures.py --json "$OUT/figures.json")
[ "$DRY" = 1 ] && FIG+=(--cpu)
stage suite figures.log "$PY" "${FIG[0]}" suite "${FIG[@]:1}"
stage compile figures.log "$PY" "${FIG[0]}" compile "${FIG[@]:1}"
stage extras figures.log "$PY" "${FIG[0]}" extras "${FIG[@]:1}"

n=$(find "$OUT" -type f | wc -l)
echo "files under OUT: $n (at most 8)" >> "$OUT/summary.txt"
[ "$n" -le 8 ] || status=1
cat "$OUT/summary.txt"
exit $status
