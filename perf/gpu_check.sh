#!/usr/bin/env bash
# perf/gpu_check.sh — the one prepared GPU check (run through the device tool on the H200 machine).
#
# Builds the extension against the machine's torch (ABI-tied: it must be built there), runs the CUDA gtests, the
# gpu-marked pytest cases and the GPU benchmark, and writes every log and JSON under $OUT (default ./gpu_out).
# Each stage has its own time budget and failure does not stop the later stages, so one run yields everything it
# can. Exit status: non-zero when the build or any test stage failed.
#
#     OUT=/some/dir bash perf/gpu_check.sh            # device tool: $OUT is set and copied back
set -u
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-16}"
PY="${PYTHON:-python3}"
status=0

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s)" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}

{ nvidia-smi; "$PY" -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } \
  > "$OUT/environment.txt" 2>&1

stage build 240 "$PY" -m pip install --no-build-isolation --no-deps -v -e . || { echo "build failed" >&2; exit 1; }
stage cpp_gpu 120 bash -c "cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE=$(command -v "$PY") \
  -DTAPESAC_BUILD_TESTS=ON -DTAPESAC_BUILD_PYTHON=OFF -DTORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST \
  && cmake --build build/gpu && ctest --test-dir build/gpu -L gpu --output-on-failure"
stage py_gpu 180 "$PY" -m pytest tests/python -q -p no:cacheprovider -m gpu -x
stage bench_gpu 240 "$PY" -m tapesac bench --size gpu1b --models qwen3 --rounds 5 --no-compile \
  --json "$OUT/bench_step_gpu1b.json" --plot "$OUT/bench_step_gpu1b.png"
cat "$OUT/summary.txt"
exit $status
