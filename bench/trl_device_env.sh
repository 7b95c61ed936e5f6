#!/usr/bin/env bash
# Sourced by the GPU machine's bench scripts that run TRL (vs_trl_gpu_device.sh,
# speed_device.sh): vLLM's environment, then TRL and its three extra packages from .trl-wheels/
# (make trl-wheels) installed once into a side folder on PYTHONPATH.
source bench/vllm_device_env.sh || return 1
if [ -d .trl-wheels ] && [ ! -d /tmp/trlsite/trl ]; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target /tmp/trlsite \
        .trl-wheels/*.whl || return 1
fi
export PYTHONPATH="$PYTHONPATH:/tmp/trlsite"
