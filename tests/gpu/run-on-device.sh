#!/usr/bin/env bash
# Run the GPU suite on a machine with an NVIDIA GPU and keep everything it printed.
#   tests/gpu/run-on-device.sh OUTPUT_DIR [PYTEST ARGS...]   (e.g. --ignore=tests/gpu/test_mps.py)
# Writes OUTPUT_DIR/environment.txt (date, device, driver, versions) and OUTPUT_DIR/pytest.log;
# docs/gpu-verification.md is written from those two files.
set -uo pipefail
out=${1:?usage: tests/gpu/run-on-device.sh OUTPUT_DIR [PYTEST ARGS...]}
shift
mkdir -p "$out"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/device: /'
    nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | sed 's/^/driver /'
    python3 - <<'PY'
import importlib, platform
print("python:", platform.python_version())
for name in ("torch", "cupy", "jax", "transformers", "timm", "lightning", "triton", "jupyter_gpushare"):
    try:
        m = importlib.import_module(name)
        extra = f" (CUDA {m.version.cuda})" if name == "torch" else ""
        print(f"{name}: {m.__version__}{extra}")
    except Exception as e:  # report, don't fail: the suite says what is missing
        print(f"{name}: not available ({e})")
PY
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"
PYTHONUNBUFFERED=1 python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log"
exit "${PIPESTATUS[0]}"
