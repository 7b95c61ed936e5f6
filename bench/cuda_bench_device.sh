#!/usr/bin/env bash
# A CPU-or-CUDA benchmark of bench/ (scaling, async_vs_sync, multi_turn) with --device cuda on
# the H200 machine: after the first two vLLM carry calls and the wheels' call (docs/cuda.md,
# section 5),
#   bash bench/cuda_bench_device.sh scaling [more bench/scaling.py options]     (carry [".vp3"])
#   bash bench/cuda_bench_device.sh async_vs_sync [more options]                (machine warm)
#   bash bench/cuda_bench_device.sh multi_turn [more options]                   (machine warm)
# Writes $OUT/<bench>_h200.json and its output (each run's line as it ends, so a call cut short
# keeps the runs it finished); on a failed run, the tails of its logs.
set -uo pipefail
bench=${1:?usage: cuda_bench_device.sh scaling|async_vs_sync|multi_turn [options]}
shift
out=${OUT:-/tmp/cuda-bench-out}
mkdir -p "$out"
source bench/vllm_device_env.sh || exit 1
python3 -c "import vllm, torch, torchft; print('vllm', vllm.__version__, 'torch', torch.__version__)"
work=/tmp/podrl-$bench
rm -rf "$work"
python3 "bench/$bench.py" --device cuda --work "$work" --out "$out/${bench}_h200.json" "$@" \
    2>&1 | grep --line-buffered -v "it/s]" | tee "$out/table_$bench.txt" | tail -n 60
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then
    for log in "$work"/run-*.log "$work"/run-*/logs/*.log; do
        [ -f "$log" ] && tail -n 80 "$log" > "$out/$(echo "${log#"$work"/}" | tr / _)"
    done
fi
exit "$rc"
