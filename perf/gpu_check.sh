#!/usr/bin/env bash
# perf/gpu_check.sh — the one prepared GPU check (run through the device tool on the H200 machine).
#
# Builds the extension and the gtests once against the machine's torch (ABI-tied: it must be built there):
# `pip install --no-build-isolation -e .` with the gtests on in the same CMake tree, or plain CMake when pip cannot
# build there (see build() below). Then runs the CUDA gtests, the gpu-marked pytest cases and the GPU benchmark, and writes every log, JSON and plot under $OUT (default
# ./gpu_out). Each stage has its own time limit and a failure does not stop the later stages, so one run yields
# everything it can. The limits add up to under 10 minutes (the device tool's limit per command): build 270 s
# (about 4 min with 16 cores), gtests 60 s, pytest 120 s, bench 130 s. Exit status: non-zero when the build or
# any test stage failed.
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

# One build for the extension and the gtests: `pip install -e` with the test executables switched on in the same
# CMake tree (build/gpu). If pip cannot build there (scikit-build-core or pybind11 missing on the machine), the same
# tree is built with CMake directly and the package is imported from the source tree.
build() {
  if "$PY" -m pip install --no-build-isolation --no-deps -v -e . --config-settings=build-dir=build/gpu \
      --config-settings=cmake.define.TAPESAC_BUILD_TESTS=ON; then
    echo "built with pip install -e"; return 0
  fi
  echo "pip install -e failed; building with CMake directly"
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")" \
    -DTAPESAC_BUILD_TESTS=ON -DTAPESAC_BUILD_PYTHON=ON -DTORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
    && cmake --build build/gpu && cp build/gpu/python/_C*.so python/tapesac/ && touch build/gpu/.from_source_tree
}
export -f build; export PY TORCH_CUDA_ARCH_LIST
stage build 270 bash -c build || { echo "build failed" >&2; cat "$OUT/summary.txt"; exit 1; }
[ -f build/gpu/.from_source_tree ] && export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
stage cpp_gpu 60 ctest --test-dir build/gpu -L gpu --output-on-failure
stage py_gpu 120 "$PY" -m pytest tests/python -q -p no:cacheprovider -m gpu --maxfail=5
# The five variants side by side on Qwen3 ~1B (bf16, seq 4096, batch 1): step time (CUDA-synchronised) and peak
# (torch.cuda.max_memory_allocated above step entry), each validated against nockpt before it is timed.
stage bench_gpu 130 "$PY" -m tapesac bench --size gpu1b --models qwen3 --batch 1 --rounds 5 --warmup 1 --no-compile \
  --variants nockpt,ckpt,torch_sac,tapesac_eager,tapesac_cuda_graph \
  --json "$OUT/bench_step_gpu1b.json" --plot "$OUT/bench_step_gpu1b.png"
cat "$OUT/summary.txt"
exit $status
