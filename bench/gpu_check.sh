#!/bin/sh
# bench/gpu_check.sh [ARGS]: the GPU check on a machine without a package index.
# The wheels it needs beyond that machine's own packages travel in .whl/ (gitignored),
# downloaded beforehand where pip works, for that machine's Python (3.12 here):
#   pyzmq and msgpack, for the benchmarks:
#     python3 -m pip download --only-binary=:all: --python-version 3.12 \
#         --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl pyzmq msgpack
#   cuda-bindings 12.9.0, whose cudaEventSynchronize holds the GIL (the wait's before and
#   after, bench/gpu_gil.py), with what pip lists beside it (nothing, for 12.9.0):
#     python3 -m pip download --only-binary=:all: --python-version 3.12 \
#         --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#         -d .whl/cb129 cuda-bindings==12.9.0
set -e
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/carpool-site .whl/*.whl
    PYTHONPATH="/tmp/carpool-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ls .whl/cb129/*.whl >/dev/null 2>&1; then
    # Its own folder: only bench/gpu_gil.py's second run puts it on its path.
    python3 -m pip install -q --no-index --find-links .whl/cb129 --no-compile \
        --no-cache-dir --upgrade --target /tmp/carpool-cb129 cuda-bindings==12.9.0
fi
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONUNBUFFERED=1
exec timeout 240 python3 bench/gpu_check.py --old-binding /tmp/carpool-cb129 "$@"
