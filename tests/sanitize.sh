#!/usr/bin/env bash
# Runs Python tests against an AddressSanitizer build of tapesac._C (issue 18 item 3: "under a sanitizer once").
#
#   bash tests/sanitize.sh [pytest arguments...]      default: the thread tests of tests/python/test_user_holes.py
#
# Builds the extension with -fsanitize=address (CPU backend only, RelWithDebInfo) in build/asan (incremental, ccache),
# puts it beside a copy of python/tapesac in build/asan/pkg, and runs pytest on that copy with libasan preloaded
# (torch and Python are not instrumented: ASan checks tapesac's own heap use — out-of-bounds, use after free, double
# free — including memory torch frees through tapesac's allocator layer). Leak detection is off: CPython and torch
# keep allocations to exit by design. Exit status: pytest's, or 66 when ASan reported an error (printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
BUILD=build/asan
PY_EXE="$("$PYTHON" -c 'import sys; print(sys.executable)')"
TORCH_CMAKE="$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
FLAGS="-fsanitize=address -fno-omit-frame-pointer"
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE="$PY_EXE" \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" -DTAPESAC_WITH_CUDA=OFF -DTAPESAC_BUILD_PYTHON=ON -DTAPESAC_BUILD_TESTS=OFF \
    -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address"
fi
cmake --build "$BUILD" --parallel "${JOBS:-2}"
so="$(find "$BUILD" -name '_C*.so' -newer CMakeLists.txt | head -n 1)"
[ -n "$so" ] || { echo "sanitize.sh: no _C*.so under $BUILD" >&2; exit 1; }
# A build that lost its flags (a cached configuration, an overridden CXXFLAGS) would pass without checking anything.
ldd "$so" | grep -q libasan || { echo "sanitize.sh: $so is not linked against libasan (a stale $BUILD? remove it)" >&2; exit 1; }
rm -rf "$BUILD/pkg" && mkdir -p "$BUILD/pkg"
cp -r python/tapesac "$BUILD/pkg/tapesac"
cp "$so" "$BUILD/pkg/tapesac/"
if [ "$#" -eq 0 ]; then
  set -- tests/python/test_user_holes.py -k "thread or threads" -p no:cacheprovider -q
fi
# libstdc++ preloaded too: ASan's __cxa_throw interceptor must resolve before any module throws (Triton's extension,
# imported by torch, throws at import: "CHECK failed: asan_interceptors.cpp ... real___cxa_throw").
LIBASAN="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libstdc++.so)"
# Reports go to build/asan/report.<pid> (pytest captures stderr, and the process exits with 66 before printing it).
rm -f "$BUILD"/report.*
export ASAN_OPTIONS="detect_leaks=0:exitcode=66:halt_on_error=1:log_path=$PWD/$BUILD/report:${ASAN_OPTIONS:-}"
# The copy must win over an installed tapesac: it comes first on the path, and the check below says which one ran.
PYTHONPATH="$PWD/$BUILD/pkg${PYTHONPATH:+:$PYTHONPATH}" LD_PRELOAD="$LIBASAN" HF_HUB_OFFLINE=1 \
  "$PYTHON" -c 'import tapesac, sys; p = tapesac._C.__file__; print("sanitize.sh: tapesac._C from", p);
sys.exit(0 if "/build/asan/pkg/" in p else 1)'
status=0
PYTHONPATH="$PWD/$BUILD/pkg${PYTHONPATH:+:$PYTHONPATH}" LD_PRELOAD="$LIBASAN" HF_HUB_OFFLINE=1 \
  "$PYTHON" -m pytest "$@" || status=$?
for r in "$BUILD"/report.*; do
  [ -e "$r" ] || continue
  echo "sanitize.sh: AddressSanitizer report $r:" >&2
  cat "$r" >&2
  status=${status/#0/66}
done
exit "$status"
