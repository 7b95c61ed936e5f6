#!/usr/bin/env bash
# bench/scaling.py --device cuda on the H200 machine (docs/scaling.md, "Measured on one H200"):
# after the first two vLLM carry calls and the wheels' call (docs/cuda.md, section 5),
#   bash bench/scaling_device.sh [more bench/scaling.py options]      (carry [".vp3"])
# Writes $OUT/scaling_h200.json and the table; on a failed run, the tails of its logs.
set -uo pipefail
out=${OUT:-/tmp/scaling-out}
mkdir -p "$out"
source bench/vllm_device_env.sh || exit 1
python3 -c "import vllm, torch, torchft; print('vllm', vllm.__version__, 'torch', torch.__version__)"
work=/tmp/podrl-scaling
rm -rf "$work"
python3 bench/scaling.py --device cuda --work "$work" --out "$out/scaling_h200.json" "$@" \
    2>&1 | grep -v "it/s]" | tail -n 40 | tee "$out/table.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then
    for log in "$work"/run-*.log "$work"/run-*/logs/*.log; do
        [ -f "$log" ] && tail -n 80 "$log" > "$out/$(echo "${log#"$work"/}" | tr / _)"
    done
fi
exit "$rc"
