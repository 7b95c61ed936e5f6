# Source on the CUDA machine from the repository root: `source bench/device_env.sh`.
# Installs the pure-Python wheels the machine lacks (pydantic, python-json-logger, grpcio 1.85
# for our generated stubs; carried in .device-wheels/) into a private folder once, and puts it
# FIRST on PYTHONPATH so its grpcio wins over the system one.
PODRL_SITE="${PODRL_SITE:-$HOME/podrl-site}"
if [ ! -d "$PODRL_SITE/pydantic" ]; then
    python -m pip install --quiet --no-index --no-deps --target "$PODRL_SITE" .device-wheels/*.whl
fi
export PYTHONPATH="services:$PODRL_SITE:.${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
