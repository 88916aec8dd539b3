# tapesac developer / CI entry points.  `make test` is what CI runs (.ci/run).
#   setup         torch (an installed torch >= 2.11 is kept; the pinned one only when none is), test deps, gtest +
#                 ccache (idempotent; a few seconds when all is there)
#   build         build + install the package into $(PYTHON) (incremental; skipped when no input changed)
#   cpp-test      gtest suites through ctest in build/cpp (label cpu)
#   py-test       pytest tests/python
#   sanitize      an AddressSanitizer build of the extension (build/asan) and the thread and fault tests on it
#   test          setup build cpp-test py-test sanitize
#   demo          python -m tapesac demo
#   bench-record  python perf/bench_record.py
#   clean         remove build outputs
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.14.1
TORCH_MIN ?= 2.11
JOBS ?= 2
CPP_BUILD_DIR ?= build/cpp
TORCH_CUDA_ARCH_LIST ?= 9.0

export CMAKE_BUILD_PARALLEL_LEVEL ?= $(JOBS)
export TORCH_CUDA_ARCH_LIST

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# What the installed package is built from. `build` reinstalls only when one of these is newer than the stamp;
# the list file also records the interpreter and the file set, so adding/removing a source or switching
# $(PYTHON) triggers a rebuild, and so does reinstalling torch (its version.py is a prerequisite).
BUILD_INPUTS := $(wildcard $(shell git ls-files --cached --others --exclude-standard -- \
	CMakeLists.txt pyproject.toml cmake common capture replay allocator planner runtime python 2>/dev/null))
TORCH_VERSION_FILE := $(wildcard $(shell $(PYTHON) -c \
	'import importlib.util as u, os; s = u.find_spec("torch"); print(os.path.join(os.path.dirname(s.origin), "version.py") if s else "")' 2>/dev/null))
# The compiler scikit-build-core picks (Python's sysconfig CXX): using the same one here lets ccache share objects
# between the pip build and build/cpp (ccache keys on the compiler name: c++ and g++ miss each other).
PY_CXX := $(shell $(PYTHON) -c 'import sysconfig; print((sysconfig.get_config_var("CXX") or "c++").split()[0])' 2>/dev/null)
BUILD_STAMP := build/.installed.stamp
BUILD_LIST := build/.installed.inputs
BUILD_KEY := $(shell command -v $(PYTHON)) $(BUILD_INPUTS)

.PHONY: setup build cpp-test py-test sanitize test demo bench-record clean FORCE

# torch: any installed torch >= $(TORCH_MIN) is kept (the GPU machine runs 2.11, CI and development 2.14.1); the pinned
# $(TORCH_VERSION) is installed only when there is none, or an older one.
setup:
	@if $(PYTHON) -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); \
			sys.exit(v < tuple(int(x) for x in "$(TORCH_MIN)".split(".")))' >/dev/null 2>&1; then \
		echo "setup: keeping torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "setup: no torch >= $(TORCH_MIN): installing torch==$(TORCH_VERSION)"; \
		$(PIP) install "torch==$(TORCH_VERSION)"; \
	fi
	@missing=""; \
	for spec in transformers:transformers accelerate:accelerate tqdm:tqdm pytest:pytest hypothesis:hypothesis \
	            matplotlib:matplotlib numpy:numpy scikit-build-core:scikit_build_core pybind11:pybind11 peft:peft; do \
		pkg=$${spec%%:*}; mod=$${spec##*:}; \
		$(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$$mod') is None)" \
			|| missing="$$missing $$pkg"; \
	done; \
	command -v cmake >/dev/null 2>&1 || missing="$$missing cmake"; \
	command -v ninja >/dev/null 2>&1 || missing="$$missing ninja"; \
	if [ -n "$$missing" ]; then echo "setup: installing$$missing"; $(PIP) install $$missing; fi
	@if [ ! -f /usr/include/gtest/gtest.h ] || ! command -v ccache >/dev/null 2>&1; then \
		echo "setup: installing libgtest-dev ccache"; \
		$(SUDO) apt-get update && $(SUDO) apt-get install -y libgtest-dev ccache; \
	fi
	@echo "setup: ok"

# Rewritten only when the key changes, so its mtime means "the input set changed".
$(BUILD_LIST): FORCE
	@mkdir -p $(@D)
	@echo '$(BUILD_KEY)' | cmp -s - $@ || echo '$(BUILD_KEY)' > $@

$(BUILD_STAMP): $(BUILD_LIST) $(BUILD_INPUTS) $(TORCH_VERSION_FILE)
	$(PIP) install --no-build-isolation --no-deps -v .
	@touch $@

# The stamp is dropped when the installed package is gone (pip uninstall, fresh venv).
build:
	@$(PYTHON) -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("tapesac") is None)' \
		2>/dev/null || rm -f $(BUILD_STAMP)
	@$(MAKE) --no-print-directory $(BUILD_STAMP)
	@echo "build: ok"

cpp-test:
	@# Configure once; afterwards ninja re-runs CMake by itself when a CMakeLists.txt or a globbed folder changes.
	[ -f $(CPP_BUILD_DIR)/build.ninja ] || CXX="$${CXX:-$(PY_CXX)}" cmake -S . -B $(CPP_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DPython_EXECUTABLE="$$($(PYTHON) -c 'import sys; print(sys.executable)')" \
		-DTAPESAC_BUILD_TESTS=ON -DTAPESAC_BUILD_PYTHON=OFF -DTORCH_CUDA_ARCH_LIST="$(TORCH_CUDA_ARCH_LIST)"
	cmake --build $(CPP_BUILD_DIR) --parallel $(JOBS)
	ctest --test-dir $(CPP_BUILD_DIR) -L cpu --output-on-failure

py-test:
	$(OFFLINE) $(PYTHON) -m pytest tests/python -q -p no:cacheprovider

# tests/sanitize.sh: the tests where a memory error would hide (other threads, exceptions mid-step) under ASan; exit
# 66 when ASan reported one. About 5 minutes on 2 cores from scratch (the build), 1-2 when built.
sanitize:
	PYTHON=$(PYTHON) JOBS=$(JOBS) bash tests/sanitize.sh tests/python/test_user_holes.py tests/python/test_faults.py \
		-p no:cacheprovider -q

test: setup
	$(MAKE) build
	$(MAKE) cpp-test
	$(MAKE) py-test
	$(MAKE) sanitize

demo: setup
	$(MAKE) build
	$(OFFLINE) $(PYTHON) -m tapesac demo

bench-record:
	$(OFFLINE) $(PYTHON) perf/bench_record.py

clean:
	rm -rf build dist
	find . -name '*.egg-info' -prune -exec rm -rf {} +
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

FORCE:
