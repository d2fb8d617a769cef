# Sourced on the device machine before a GPU campaign's commands:  . tests/gpu/device-setup.sh COMMIT
# Installs the wheels carried in .whl/ (the Jupyter stack, cffi, the project's own wheel for its
# entry points; docs/gpu-verification.md says how they are made) into /tmp/site, builds the shim
# into the package, and names the commit that the benchmarks' records carry (the copy on the
# device has no git history).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site GPUSHARE_BENCH_COMMIT=${1:?usage: . tests/gpu/device-setup.sh COMMIT}
export PYTHONUNBUFFERED=1
python3 native/build.py shim jupyter_gpushare/lib/libgpushare.so || return 1
