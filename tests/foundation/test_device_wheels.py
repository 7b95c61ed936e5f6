"""bench/device_wheels.sh carries every package podrl's services import at start that the GPU
machine lacks (docs/cuda.md). A multi-pod run there once failed at start: the grader imported
pebble and the controller the kubernetes client, and neither was carried."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The modules each service process (and `podrl run`, the Lighthouse) imports before it serves.
ENTRY_MODULES = (
    "podrl.cli.main",
    "podrl.controller.service.main",
    "podrl.grader.main",
    "podrl.trainer.main",
    "podrl.trainer.lighthouse",
    "podrl.generator.servicer",
    "torchft.manager",
    "torchft.process_group",
    "torchft.checkpointing",
)

# What the GPU machine has of its own (the workplace's ENVIRONMENT.md: torch, numpy, grpcio,
# protobuf, safetensors, transformers, prometheus-client, ...) and what the vLLM pieces bring
# (the workplace's vllm-0.26.0-cuda-deps.txt: OpenTelemetry for torchft, dill, pydantic extras;
# every distribution of the shared ``opentelemetry`` namespace counts as its owner).
ON_THE_MACHINE = {
    "torch", "numpy", "triton", "safetensors", "transformers", "tokenizers", "huggingface-hub",
    "prometheus-client", "grpcio", "protobuf", "packaging", "tqdm", "filelock", "fsspec",
    "regex", "sympy", "networkx", "mpmath", "psutil", "setuptools", "hf-xet",
}  # fmt: skip
IN_THE_VLLM_PIECES = {
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-otlp-proto-common", "opentelemetry-proto",
    "opentelemetry-semantic-conventions", "opentelemetry-semantic-conventions-ai",
    "opentelemetry-exporter-otlp", "opentelemetry-exporter-otlp-common",
    "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-http-transport",
    "googleapis-common-protos", "dill",
    "email-validator", "dnspython", "pydantic-extra-types", "python-multipart", "watchfiles",
    "sniffio",
}  # fmt: skip
# Imported only when present (a try/except ImportError in the importer): blocked below, so the
# check sees what a machine without them imports.
OPTIONAL = ("kubernetes_validate", "grpc_tools")

PROBE = """
import importlib, importlib.abc, importlib.metadata, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ImportError(name)
        return None
sys.meta_path.insert(0, Block())
before = {name.split(".")[0] for name in sys.modules}
for module in ENTRY:
    importlib.import_module(module)
tops = {name.split(".")[0] for name in sys.modules} - before - set(sys.stdlib_module_names)
owners = importlib.metadata.packages_distributions()
print(json.dumps(sorted({d for top in tops for d in owners.get(top, [])})))
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _carried() -> set[str]:
    script = (REPO / "bench/device_wheels.sh").read_text()
    listed = re.search(r"^packages=\((.*?)^\)", script, re.S | re.M)
    assert listed, "bench/device_wheels.sh has no packages=( ... ) list"
    return {_canonical(name) for name in listed.group(1).split()}


def test_every_package_the_services_import_at_start_reaches_the_gpu_machine() -> None:
    code = f"OPTIONAL = {OPTIONAL!r}\nENTRY = {ENTRY_MODULES!r}\n{PROBE}"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    imported = {_canonical(d) for d in json.loads(done.stdout.splitlines()[-1])}
    assert "kubernetes" in imported and "pebble" in imported  # the probe sees the services
    provided = _carried() | {_canonical(d) for d in ON_THE_MACHINE | IN_THE_VLLM_PIECES}
    missing = sorted(imported - provided - {"podrl"})
    assert not missing, f"add to bench/device_wheels.sh (and constraints.txt): {missing}"
