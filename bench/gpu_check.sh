#!/bin/sh
# bench/gpu_check.sh [ARGS]: the GPU check on a machine without a package index.
# The wheels it needs beyond that machine's own packages (pyzmq and msgpack for Python
# 3.12) travel in .whl/ (gitignored), downloaded beforehand where pip works:
#   python3 -m pip download --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl pyzmq msgpack
set -e
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/carpool-site .whl/*.whl
    PYTHONPATH="/tmp/carpool-site${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONUNBUFFERED=1
exec timeout 240 python3 bench/gpu_check.py "$@"
