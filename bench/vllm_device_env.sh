# Source on the H200 machine from the repository root, in the third vLLM carry call or a later
# call while the machine is still warm (docs/cuda.md, "vLLM on the H200"):
#   source bench/vllm_device_env.sh      (carry [".vp3", ".device-wheels"] the first time)
# Unpacks vLLM 0.26.0 from the pieces of ../shared/tools/vllm-cuda-pieces.sh (the first two
# already copied to /tmp/vp by the first two calls) into /tmp/vsite, installs .device-wheels/
# into /tmp/psite, each once per warm machine, and sets PYTHONPATH: podrl's services and our
# grpcio/protobuf (the generated stubs' versions) first, vLLM's site last.
vllm_env_started=$(date +%s)
mkdir -p /tmp/vp /tmp/vsite
if [ ! -d /tmp/vsite/vllm ]; then
    cp .vp3/* /tmp/vp/ || return 1
    cat /tmp/vp/piece.* | xz -d -T8 | tar -x -C /tmp/vsite || return 1
fi
if [ ! -d /tmp/psite/pydantic ] || [ ! -d /tmp/psite/kubernetes ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/psite \
        .device-wheels/*.whl || return 1
fi
echo "vLLM unpacked and wheels installed in $(($(date +%s) - vllm_env_started)) s"
export PYTHONPATH="services:/tmp/psite:.:/tmp/vsite"
export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
