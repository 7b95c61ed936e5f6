# Source on the CUDA machine from the repository root: `source bench/device_env.sh`
# (.device-wheels/ is built here by `bash bench/device_wheels.sh`).
# Installs the pure-Python wheels the machine lacks (pydantic, python-json-logger, grpcio 1.85
# for our generated stubs, the controller's and CLI's packages; carried in .device-wheels/)
# into a private folder, again whenever the carried set changes, and puts it FIRST on
# PYTHONPATH (before what PYTHONPATH held) so its grpcio wins over the system one. A call
# that does not carry .device-wheels/ uses what an earlier call of a warm machine installed.
PODRL_SITE="${PODRL_SITE:-$HOME/podrl-site}"
if [ -d .device-wheels ]; then
    podrl_wheels=$(cd .device-wheels && ls -- *.whl | sort | tr '\n' ' ')
    if [ "$(cat "$PODRL_SITE/.podrl-wheels" 2>/dev/null)" != "$podrl_wheels" ]; then
        python3 -m pip install --quiet --upgrade --no-index --no-deps --no-compile \
            --target "$PODRL_SITE" .device-wheels/*.whl || return 1
        echo "$podrl_wheels" > "$PODRL_SITE/.podrl-wheels"
    fi
elif [ ! -f "$PODRL_SITE/.podrl-wheels" ]; then
    echo "device_env.sh: no .device-wheels/ carried and none installed in $PODRL_SITE" >&2
    return 1
fi
export PYTHONPATH="services:$PODRL_SITE:.${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
# PODRL_* variables are run-config overrides: this one only named the folder above.
unset PODRL_SITE
