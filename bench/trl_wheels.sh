#!/usr/bin/env bash
# Builds .trl-wheels/ (gitignored): TRL and the packages the GPU machine lacks for it, for its
# CPython 3.12, carried to bench/vs_trl_gpu.py's device call (docs/cuda.md, "A GPU run that
# learns"; bench/vs_trl_gpu_device.sh installs them). The machine has accelerate, transformers,
# pyarrow, pandas and xxhash of its own, and vLLM 0.26 comes with the vLLM pieces; TRL's
# datasets needs multiprocess and dill beside them. Pure-Python wheels (multiprocess's is the
# py312 build), about 1.7 MB: they fit one device call with .vp3.
#
#   bash bench/trl_wheels.sh [OUTDIR]     (default: .trl-wheels; needs pip and an index)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.trl-wheels}
packages=(trl==1.16.0 datasets==4.8.5 multiprocess==0.70.19 dill==0.4.1)
rm -rf "$out"
mkdir -p "$out"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform any -d "$out" "${packages[@]}"
echo "wrote $(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1), to $out"
