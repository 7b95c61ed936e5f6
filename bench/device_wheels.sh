#!/usr/bin/env bash
# Builds .device-wheels/ (gitignored): the packages the CUDA machine lacks for podrl's trainer,
# generator, grader, controller and CLI, at the versions constraints.txt pins: pure-Python ones,
# CPython 3.12 manylinux builds of grpcio, pydantic-core, PyYAML, MarkupSafe and torchft (pods
# training together), pebble (the grader's scoring pool) and the official kubernetes client (the
# controller's watch) with their dependencies. torchft's OpenTelemetry packages come with the
# vLLM pieces (../shared/tools/vllm-cuda-pieces.sh); requests is what their exporter imports.
# bench/device_env.sh installs them there; the machine has torch, numpy, transformers,
# safetensors and prometheus-client of its own (ENVIRONMENT.md of the workplace).
#
#   bash bench/device_wheels.sh [OUTDIR]     (default: .device-wheels; needs pip and an index)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.device-wheels}
packages=(
    grpcio grpcio-health-checking grpcio-reflection protobuf
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    python-json-logger PyYAML rich markdown-it-py mdurl pygments
    httpx httpcore h11 anyio idna certifi
    fastapi starlette annotated-doc uvicorn click Jinja2 MarkupSafe tensorboardX
    torchft requests urllib3 charset-normalizer
    pebble kubernetes durationpy oauthlib python-dateutil six requests-oauthlib websocket-client
)
plat=""
for p in manylinux_2_17 manylinux2014 manylinux_2_28 manylinux_2_34 linux; do
    plat="$plat --platform ${p}_x86_64"
done
rm -rf "$out"
mkdir -p "$out"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $plat -c constraints.txt -d "$out" "${packages[@]}"
echo "wrote $(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1), to $out"
