#!/usr/bin/env bash
# The GPU speed measurements in one device call on one H200 (docs/performance.md, "On the
# GPU"), after the first two vLLM carry calls (docs/cuda.md, section 4):
#   bash bench/speed_device.sh          carry [".vp3", ".trl-wheels"]
# .trl-wheels/ as for bench/vs_trl_gpu_device.sh. In order, each part cut off when the call's
# budget (SPEED_BUDGET_S, 530 s) runs out, every part writing its JSON as it goes:
#   1. bench/vs_trl_gpu.py --speed, workload A (16 x 8, <= 6 tokens): TRL, podrl sync, async;
#   2. bench/train_step_profile.py, workload A, trainer.fsdp always (before) and auto (after);
#   3. bench/vs_trl_gpu.py --speed, workload B (64 x 8, 256 tokens);
#   4. bench/train_step_profile.py, workload B, after only.
# Writes $OUT/speed_A.json, profile_A.json, speed_B.json, profile_B.json, the printed tables
# (*.txt) and the runs' logs (logs.tgz).
set -uo pipefail
# The budget counts from here: unpacking vLLM on a cold machine is part of the call's time.
started=$(date +%s)
out=${OUT:-/tmp/speed-out}
mkdir -p "$out"
source bench/trl_device_env.sh || exit 1
budget=${SPEED_BUDGET_S:-530}
left() { echo $((budget - ($(date +%s) - started))); }
part() {  # part NAME COMMAND...: run it within what is left of the budget
    local name=$1 rest
    shift
    rest=$(left)
    if [ "$rest" -le 20 ]; then
        echo "skipped $name: the budget is spent" | tee -a "$out/skipped.txt"
        return 0
    fi
    echo "== $name ($rest s left)"
    timeout "$rest" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]} after $(($(date +%s) - started)) s"
}
speed=(python3 -m bench.vs_trl_gpu --speed --systems trl,podrl-sync,podrl-async --run-timeout 240)
profile=(python3 -m bench.train_step_profile --device cuda --shape 0.6b)
part speed_A "${speed[@]}" --workloads A --out "$out/speed_A.json"
part profile_A "${profile[@]}" --workloads A --variants before,after --out "$out/profile_A.json"
part speed_B "${speed[@]}" --workloads B --out "$out/speed_B.json"
part profile_B "${profile[@]}" --workloads B --variants after --steps 10 --out "$out/profile_B.json"
work=/tmp/podrl-vs-trl
(cd "$work" && for f in *.log; do tail -n 200 "$f" > "$out/log-$f"; done) 2>/dev/null
tar -C "$out" -czf "$out/logs.tgz" --remove-files $(cd "$out" && ls log-* 2>/dev/null) 2>/dev/null
exit 0
