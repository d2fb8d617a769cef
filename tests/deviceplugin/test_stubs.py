"""The committed modules (v1beta1, podresources) are protoc's output for their api.proto as it is
now, and the k8s extra asks for the grpcio and protobuf those modules were generated for."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from jupyter_gpushare.deviceplugin import regenerate
from jupyter_gpushare.deviceplugin.podresources import api_pb2 as podresources_pb2
from jupyter_gpushare.deviceplugin.v1beta1 import api_pb2

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "jupyter_gpushare" / "deviceplugin" / "v1beta1"
VERSION_LINE = re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M)


def test_committed_modules_match_the_proto(tmp_path: Path) -> None:
    written = regenerate.regenerate(tmp_path)
    assert len(written) == 4
    pairs = zip(written[::2], written[1::2], (api_pb2, podresources_pb2), strict=True)
    for fresh_pb2, fresh_grpc, module in pairs:
        # The messages: compare descriptors, not text (protoc's layout changes between releases).
        text = fresh_pb2.read_text()
        serialized = re.search(r"AddSerializedFile\((b'.*?')\)", text, re.S)
        assert serialized, "protoc's output changed shape"
        fresh = descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(serialized.group(1)))
        committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert fresh == committed, "run: python -m jupyter_gpushare.deviceplugin.regenerate"
        # The services: the grpc module, but for the grpcio version it was generated with.
        ours = VERSION_LINE.sub("", (Path(module.__file__).parent / "api_pb2_grpc.py").read_text())
        assert VERSION_LINE.sub("", fresh_grpc.read_text()) == ours


def test_wire_names_are_the_kubelets() -> None:
    """The kubelet calls /v1beta1.DevicePlugin/Allocate etc.: the package must stay v1beta1."""
    assert api_pb2.DESCRIPTOR.package == "v1beta1"
    services = {
        s.name: [m.name for m in s.methods] for s in api_pb2.DESCRIPTOR.services_by_name.values()
    }
    assert services == {
        "Registration": ["Register"],
        "DevicePlugin": ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation",
                         "Allocate", "PreStartContainer"],
    }  # fmt: skip
    # The kubelet serves /v1.PodResourcesLister/List.
    assert podresources_pb2.DESCRIPTOR.package == "v1"
    [lister] = podresources_pb2.DESCRIPTOR.services_by_name.values()
    assert (lister.name, [m.name for m in lister.methods]) == ("PodResourcesLister", ["List"])


def test_the_k8s_extra_allows_what_the_modules_need() -> None:
    grpc_text = (GENERATED / "api_pb2_grpc.py").read_text()
    pb2_text = (GENERATED / "api_pb2.py").read_text()
    grpc_needs = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_text).group(1)
    pb_needs = re.search(r"Protobuf Python Version: ([\d.]+)", pb2_text).group(1)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["k8s"]
    assert f"grpcio>={grpc_needs}" in extra, extra
    major = int(pb_needs.split(".")[0])
    assert f"protobuf>={pb_needs},<{major + 1}" in extra, extra
