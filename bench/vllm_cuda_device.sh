#!/usr/bin/env bash
# The third of the three vLLM carry calls on the H200 machine (docs/cuda.md, "vLLM on the H200"):
# unpacks vLLM 0.26.0 (pieces from ../shared/tools/vllm-cuda-pieces.sh, the first two already in
# /tmp/vp), installs the carried wheels (.device-wheels/), then runs tests/gpu/test_vllm_cuda.py
# with the measurements on; the JSON, the pytest log and the services' logs land in $OUT.
#
#   bash bench/vllm_cuda_device.sh [SECONDS]   (carry [".vp3", ".device-wheels"]; SECONDS: the
#                                               call's limit, default 600)
set -uo pipefail
limit=${1:-600}
out=${OUT:-/tmp/vllm-cuda-out}
mkdir -p "$out"
started=$(date +%s)
source bench/vllm_device_env.sh || exit 1
export BENCH_VLLM_OUT="$out/vllm_cuda_h200.json"
# The harness skips optional phases that would not end this many seconds after it starts
# (a margin for pytest's start, the services' shutdown and the table).
export BENCH_VLLM_BUDGET=$((limit - ($(date +%s) - started) - 50))
echo "harness budget: $BENCH_VLLM_BUDGET s" 
python3 -c "import vllm, torch, grpc; print('vllm', vllm.__version__, 'torch', torch.__version__, 'grpc', grpc.__version__)"
python3 -m pytest -q -p no:cacheprovider -o timeout=0 -s tests/gpu/test_vllm_cuda.py 2>&1 \
    | tee "$out/pytest.log" | grep -v -E "^\(EngineCore|^INFO|^DEBUG" | tail -n 120
rc=$?
for f in /tmp/pytest-of-*/pytest-*/vllm-cuda*/trainer/trainer.log; do
    [ -f "$f" ] && tail -n 200 "$f" > "$out/trainer.log"
done
python3 -c "import json,sys; from bench.vllm_cuda import Results, table; \
r = Results(**{k: v for k, v in json.load(open(sys.argv[1])).items()}); print(table(r))" \
    "$BENCH_VLLM_OUT" | tee "$out/table.txt"
exit $rc
