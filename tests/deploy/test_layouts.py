"""deploy/kubernetes's GPU layouts: each pairing of manifests and Zero to JupyterHub values that
docs/operators/kubernetes.md offers gives the user pods GPUs from one device plugin only. With
gpushare's plugin in the DaemonSet (the base kustomization) the pods ask for
gpushare.io/gpu-memory and never nvidia.com/gpu; with the time-slicing component (the plugin
removed) they never ask for gpushare.io/gpu-memory. Checked on the files as written, and with
`kubectl kustomize` where kubectl is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_kubernetes_manifests import DEDICATED, KUBE, TIME_SLICING, load, values

COMPONENT = KUBE / "time-slicing"
#: layout -> (values overlays of z2jh-values.yaml, whether the time-slicing component is used)
LAYOUTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpushare device plugin": ((), False),
    "time-slicing": ((TIME_SLICING,), True),
    "dedicated pool": ((TIME_SLICING, DEDICATED), True),
}


def asked_resources(vals: dict[str, Any]) -> list[set[str]]:
    """The extended resources a user pod asks for, one set per profile (or one without)."""
    su = vals["singleuser"]
    base = set((su.get("extraResource", {}).get("limits") or {}).keys())
    profiles = su.get("profileList") or [{}]
    out = []
    for profile in profiles:
        override = profile.get("kubespawner_override", {})
        out.append(base | set((override.get("extra_resource_limits") or {}).keys()))
    return out


def containers_removed_by_component() -> set[str]:
    component = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    removed = set()
    for patch in component["patches"]:
        doc = yaml.safe_load(patch["patch"])
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c.get("$patch") == "delete":
                removed.add(c["name"])
    return removed


def plugin_resource(daemonset: dict[str, Any]) -> str | None:
    for c in daemonset["spec"]["template"]["spec"]["containers"]:
        if c["name"] == "device-plugin":
            [arg] = [a for a in c["args"] if a.startswith("--resource-name=")]
            return str(arg.split("=", 1)[1])
    return None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_gets_gpus_from_one_device_plugin(layout: str) -> None:
    overlays, component = LAYOUTS[layout]
    daemonset = load("daemonset.yaml")
    if component:
        containers = daemonset["spec"]["template"]["spec"]["containers"]
        removed = containers_removed_by_component()
        daemonset["spec"]["template"]["spec"]["containers"] = [
            c for c in containers if c["name"] not in removed
        ]
    resource = plugin_resource(daemonset)
    for asked in asked_resources(values(*overlays)):
        if resource is not None:
            # gpushare's plugin hands out these nodes' GPUs: a pod asking NVIDIA's plugin too
            # would get a GPU of its own count, or none (docs/operators/helm.md).
            assert resource in asked and "nvidia.com/gpu" not in asked, (layout, asked)
        else:
            assert "gpushare.io/gpu-memory" not in asked, (layout, asked)


def test_kustomize_builds_each_layout(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the layout check above reads the files)")
    for layout, (_, component) in LAYOUTS.items():
        overlay = tmp_path / layout.replace(" ", "-")
        overlay.mkdir()
        base = os.path.relpath(KUBE, overlay)
        doc: dict[str, Any] = {"resources": [base]}
        if component:
            doc["components"] = [os.path.relpath(COMPONENT, overlay)]
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump(doc))
        out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr
        [ds] = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "DaemonSet"]
        names = {c["name"] for c in ds["spec"]["template"]["spec"]["containers"]}
        assert names == ({"scheduler"} if component else {"scheduler", "device-plugin"}), layout
