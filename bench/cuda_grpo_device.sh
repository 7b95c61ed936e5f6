#!/usr/bin/env bash
# bench/cuda_grpo.py on the H200 machine, one memory mode per call (docs/cuda.md, "One GPU,
# four services"): after the first two vLLM carry calls,
#   bash bench/cuda_grpo_device.sh sleep_during_train   (carry [".vp3"]; the wheels installed
#   by a call of their own before it: docs/cuda.md, section 5)
# and, while the machine is still warm (vLLM, the wheels and the warm-started model are then
# reused from /tmp),
#   bash bench/cuda_grpo_device.sh resident
# Each writes $OUT/cuda_grpo_<mode>.json, the table and the run's logs.
set -uo pipefail
mode=${1:?usage: cuda_grpo_device.sh MODE [more bench/cuda_grpo.py options]}
shift
out=${OUT:-/tmp/cuda-grpo-out}
mkdir -p "$out"
source bench/vllm_device_env.sh || exit 1
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
python3 -m bench.cuda_grpo --modes "$mode" --out "$out/cuda_grpo_$mode.json" "$@" \
    2>&1 | tail -n 60 | tee "$out/table_$mode.txt"
rc=${PIPESTATUS[0]}
work=/tmp/podrl-cuda-grpo
cp "$work/$mode-podrl-run.log" "$out/" 2>/dev/null
for f in "$work/$mode"/logs/*.log; do [ -f "$f" ] && tail -n 150 "$f" > "$out/$mode-$(basename "$f")"; done
exit "$rc"
