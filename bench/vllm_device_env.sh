# Source on the H200 machine from the repository root, in the third vLLM carry call or a later
# call while the machine is still warm (docs/cuda.md, "vLLM on the H200"):
#   source bench/vllm_device_env.sh      (carry [".vp3"], and ".device-wheels" if it fits)
# Unpacks vLLM 0.26.0 from the pieces of ../shared/tools/vllm-cuda-pieces.sh (the first two
# already copied to /tmp/vp by the first two calls) into /tmp/vsite, once per warm machine,
# then bench/device_env.sh installs .device-wheels/ into /tmp/psite and sets PYTHONPATH:
# podrl's services and our grpcio/protobuf (the generated stubs' versions) first, vLLM's
# site last.
vllm_env_started=$(date +%s)
mkdir -p /tmp/vp /tmp/vsite
if [ ! -d /tmp/vsite/vllm ]; then
    cp .vp3/* /tmp/vp/ || return 1
    cat /tmp/vp/piece.* | xz -d -T8 | tar -x -C /tmp/vsite || return 1
fi
export PODRL_SITE=/tmp/psite PYTHONPATH=/tmp/vsite
source bench/device_env.sh || return 1
echo "vLLM unpacked and wheels installed in $(($(date +%s) - vllm_env_started)) s"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
