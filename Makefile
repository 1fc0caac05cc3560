# dllm_ops entry points. `make demo` runs the main job, `make test` the suite.
# Both set up everything on a fresh machine: a .venv with pinned deps, the
# extension built with its CUDA kernels (no GPU needed to compile them).

PYTHON   ?= python3
VENV     ?= .venv
VPY      := $(VENV)/bin/python
NPROC    := $(shell nproc 2>/dev/null || echo 2)
export MAX_JOBS ?= $(NPROC)
export TORCH_CUDA_ARCH_LIST ?= 9.0
# The nvcc on PATH may be a wrapper; tools/cuda_home.py finds the real root.
CUDA_HOME ?= $(shell $(PYTHON) tools/cuda_home.py)
export CUDA_HOME

.PHONY: venv build eval test test-slow test-ray pytest ctest sanitize mutate mutate-fast demo tiny-models gpu-check gpu-wheels clean

# ---- set-up ------------------------------------------------------------------
$(VENV)/.deps-stamp: requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install --progress-bar on -r requirements.txt
	touch $@

venv: $(VENV)/.deps-stamp

# Incremental (ninja) in-place build; a .pth makes `import dllm_ops` work from
# anywhere inside the venv, another lets the plain `lm_eval` command find the
# model `dllm_ops` (_dllm_ops_lm_eval.py; it imports nothing until lm_eval loads).
# $(VENV)/bin/dllm-ops runs `python -m dllm_ops` (pip installs get it as a console script).
PURELIB = $$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
build: venv
	$(VPY) setup.py -q build_ext --inplace
	echo "$(CURDIR)" > "$(PURELIB)/dllm_ops.pth"
	echo "import _dllm_ops_lm_eval" > "$(PURELIB)/dllm_ops_lm_eval.pth"
	printf '#!/bin/sh\n# dllm-ops = python -m dllm_ops (written by `make build`; pip installs the console script)\nexec "%s" -m dllm_ops "$$@"\n' "$(abspath $(VPY))" > "$(VENV)/bin/dllm-ops"
	chmod +x "$(VENV)/bin/dllm-ops"

# lm-eval (pinned in requirements.txt, so `build` installs it; the model is
# dllm_ops/lm_eval_model.py): the suite as local lm-eval tasks, then the plain
# `lm_eval` command on the multiple-choice group with tiny-llada (README "lm-eval").
EVAL_TASKS ?= build/lm_eval_tasks
EVAL_N     ?= 200
EVAL_ARGS  ?= pretrained=tiny-llada,dtype=float32,mc_num=16,mc_batch_size=64,greedy_check=false
eval: build
	$(VPY) scripts/make_lm_eval_task.py --out $(EVAL_TASKS) --n $(EVAL_N)
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(VENV)/bin/lm_eval --model dllm_ops --model_args $(EVAL_ARGS) \
	  --tasks dllm_tasks_mc --include_path $(EVAL_TASKS) --output_path build/lm_eval_results

# ---- tests -------------------------------------------------------------------
# `make test` (= .ci/run) leaves out the tests marked slow (the full re-training
# of both tiny models, ~20 min on 2026-12-01; the calibration CLI end to end):
# `make test-slow` runs them. README.md "Tests and CI time" has the measured budget.
test: build
	$(VPY) -m pytest python_tests -ra -m "not slow"
	$(MAKE) ctest
	$(MAKE) sanitize
	$(MAKE) mutate-fast

pytest: build
	$(VPY) -m pytest python_tests -ra -m "not slow"

test-slow: build
	$(VPY) -m pytest python_tests -ra -m slow

# Server replicas under Ray Serve (python -m dllm_ops serve --ray): installs the
# optional [ray] extra (requirements-ray.txt) into .venv, then runs its test
# (python_tests/test_serve_ray.py: 2 replicas, a killed replica; ~4 min here).
test-ray: build
	$(VPY) -m pip install -q -r requirements-ray.txt
	$(VPY) -m pytest python_tests -ra -m ray

# CMake build of the same csrc/ + C++ tests (shared math, simulated kernels).
CMAKE_DIR := build/cmake
ctest: venv
	scripts/cmake_configure.sh $(VPY) $(CMAKE_DIR)
	# The op library itself is built (instrumented) by `sanitize`; here only the tests
	# and the torch-free header check (CMakeLists.txt).
	cmake --build $(CMAKE_DIR) -j $(MAX_JOBS) --target test_dllm_math test_sim_kernels torch_free_headers
	ctest --test-dir $(CMAKE_DIR) --output-on-failure

# Sanitizers: TSan over the simulator's threads engine and ASan/UBSan over the
# fiber engine (torch-free kernel driver), then ASan/UBSan over the CPU kernels
# by running the CPU tests against an instrumented build of the op library.
ASAN_DIR := build/asan
sanitize: venv
	scripts/sanitize_sim.sh csrc/tests/sim_kernels_main.cpp
	scripts/cmake_configure.sh $(VPY) $(ASAN_DIR) -DDLLM_SANITIZE=address,undefined
	cmake --build $(ASAN_DIR) -j $(MAX_JOBS) --target dllm_ops_lib
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	DLLM_OPS_LIBRARY=$(CURDIR)/$(ASAN_DIR)/libdllm_ops_lib.so \
	  $(VPY) -m pytest python_tests -q -p no:cacheprovider -k "cpu and not sim and not cuda" -m "not slow and not models"

# Mutation check (tools/mutate.py, the list in tools/mutations.py): each named
# bug planted in a copy of the tree under build/mutate/ (never in this one), one
# at a time; the tests that must catch it run; a table `mutation | caught by |
# result`; non-zero exit if any survives or no longer applies. `mutate` runs
# the whole list, `mutate-fast` the subset marked fast (part of `make test`).
# README.md "Tests and CI time" has their measured times.
mutate: build
	$(VPY) tools/mutate.py

mutate-fast: build
	$(VPY) tools/mutate.py --fast

# ---- main job ----------------------------------------------------------------
# Exact match, NFE, tokens/s and agreement with vanilla of the shipped
# tiny-llada on 500 held-out problems per task, for every cache mode.
demo: build
	mkdir -p build
	$(VPY) -m bench decode --model tiny-llada --task all --n 500 --csv build/demo.csv
	$(VPY) -m bench plot build/demo.csv

# Re-train the shipped tiny models into dllm_ops/checkpoints, overwriting them
# (dllm_ops/checkpoints/README.md): both at once, one core each; the llada
# log goes to build/train-tiny-llada.log.
tiny-models: build
	mkdir -p build
	$(VPY) scripts/train_tiny.py --model tiny-llada > build/train-tiny-llada.log 2>&1 & a=$$!; \
	$(VPY) scripts/train_tiny.py --model tiny-dream; b=$$?; \
	wait $$a; c=$$?; cat build/train-tiny-llada.log; test $$b -eq 0 -a $$c -eq 0

# ---- serving -----------------------------------------------------------------
# The shipped tiny-llada over HTTP (OpenAI API: python -m dllm_ops serve,
# dllm_ops/serve) on 127.0.0.1:$(SERVE_PORT), Fast-dLLM's dual cache with the
# threshold rule in the task suite's 16-token blocks; SIGTERM (or Ctrl+C)
# drains and stops it. `make bench-serve` starts its own server and loads it
# at concurrency 1, 4, 16, 64 (bench/serve.py).
SERVE_PORT ?= 8000
SERVE_ARGS ?= --cache dual --unmask threshold --threshold 0.9 --block-length 16
.PHONY: serve bench-serve
serve: build
	$(VPY) -m dllm_ops serve --model tiny-llada --host 127.0.0.1 --port $(SERVE_PORT) $(SERVE_ARGS)

bench-serve: build
	$(VPY) -m bench serve --spawn tiny-llada --requests 32 --time-limit 120

# ---- GPU machine -------------------------------------------------------------
# One prepared command for a machine with a GPU (scripts/gpu_check.sh): that
# machine's python3, nothing installed; builds for sm_90, runs the whole suite's
# CUDA half (ops, models in fp32/bf16/fp16, the decode loop) with every skip a
# failure, then bench ops and bench decode on CUDA; one report file.
GPU_REPORT ?= build/gpu-check.txt
gpu-check:
	scripts/gpu_check.sh $(PYTHON) $(GPU_REPORT)

# The server's packages as CPython 3.12 wheels in .whl/ for the GPU image,
# which lacks them (scripts/gpu_wheels.sh); carried there, gpu-check installs
# them and adds the HTTP server's load test on the GPU.
gpu-wheels: venv
	scripts/gpu_wheels.sh

clean:
	rm -rf build dllm_ops/*.so
