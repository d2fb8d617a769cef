"""Regenerate the Python modules (api_pb2.py, api_pb2_grpc.py) of the kubelet APIs the device
plugin speaks: v1beta1/api.proto (device plugins) and podresources/api.proto (pod resources).

    python -m jupyter_gpushare.deviceplugin.regenerate [OUTPUT_ROOT]

Needs grpcio-tools (the test extra has it). The generated modules are committed, so installing
the package needs no protobuf compiler; tests/deviceplugin/test_stubs.py regenerates them into a
temporary directory and fails when the committed ones describe a different API.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = (
    "jupyter_gpushare/deviceplugin/v1beta1/api.proto",
    "jupyter_gpushare/deviceplugin/podresources/api.proto",
)


def regenerate(output_root: Path = ROOT) -> list[Path]:
    """Run protoc (grpc_tools) on each .proto; return the modules it wrote under output_root
    (api_pb2.py, api_pb2_grpc.py of each, in the order of PROTOS)."""
    from grpc_tools import protoc  # type: ignore[import-untyped]

    out = str(output_root)
    written = []
    for proto in PROTOS:
        # Paths relative to the repository root, so the generated modules import each other as
        # jupyter_gpushare.deviceplugin.v1beta1.api_pb2 (the package stays "v1beta1" on the wire).
        code = protoc.main(["protoc", f"-I{ROOT}", f"--python_out={out}",
                            f"--grpc_python_out={out}", str(ROOT / proto)])  # fmt: skip
        if code != 0:
            raise RuntimeError(f"protoc failed ({code}) on {proto}")
        base = output_root / Path(proto).parent
        written += [base / "api_pb2.py", base / "api_pb2_grpc.py"]
    return written


if __name__ == "__main__":  # pragma: no cover
    for path in regenerate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
