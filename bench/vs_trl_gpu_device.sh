#!/usr/bin/env bash
# bench/vs_trl_gpu.py on the H200 machine (docs/cuda.md, "A GPU run that learns"): after the
# first two vLLM carry calls (and the wheels' call when .vp3 and .device-wheels pass 64 MiB
# together: docs/cuda.md, section 4),
#   bash bench/vs_trl_gpu_device.sh [bench/vs_trl_gpu.py options]     (the whole run: below)
# carry [".vp3", ".trl-wheels"]: .trl-wheels/ holds TRL and the three packages the machine lacks
# for it (trl 1.16.0, datasets 4.8.5, multiprocess 0.70.19, dill 0.4.1), built here by
# `make trl-wheels` (bench/trl_wheels.sh). Writes $OUT/vs_trl_gpu.json, the printed table and
# the runs' logs (one tar).
set -uo pipefail
out=${OUT:-/tmp/vs-trl-out}
mkdir -p "$out"
source bench/trl_device_env.sh || exit 1
python3 -c "import vllm, torch, trl; print('vllm', vllm.__version__, 'torch', torch.__version__, 'trl', trl.__version__)"
# The whole learning run by default: 3 seeds x {TRL, podrl in-flight, sync, async}, 6 at a time
# (TRL's runs, the longest, start first), first starts 10 s apart; options given override these.
python3 -m bench.vs_trl_gpu --out "$out/vs_trl_gpu.json" --concurrency 6 --stagger 10 \
    --run-timeout 300 --systems trl,podrl-in-flight,podrl-sync,podrl-async "$@" 2>&1 \
    | tee "$out/vs_trl_gpu.txt"
rc=${PIPESTATUS[0]}
work=/tmp/podrl-vs-trl
(cd "$work" && for f in *.log; do tail -n 200 "$f" > "$out/log-$f"; done) 2>/dev/null
tar -C "$out" -czf "$out/logs.tgz" --remove-files $(cd "$out" && ls log-* 2>/dev/null) 2>/dev/null
exit "$rc"
