"""docs/operators/README.md's feature-by-deployment table against what each deployment really
gets: every cell's "yes" or "no" is derived here from the scheduler's defaults (embedded), the
systemd unit, the chart as the real Helm renders it, and the generated plain manifests. A cell that
says "yes" where the deployment cannot have the feature (or "no" where it has it) fails."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler
from tests.deploy import helm_sdk

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "docs" / "operators" / "README.md"
CHART = ROOT / "deploy" / "helm" / "jupyter-gpushare"
UNIT = ROOT / "deploy" / "systemd" / "gpushare-scheduler.service"
KUBE = ROOT / "deploy" / "kubernetes"
DEPLOYMENTS = ("embedded", "systemd node scheduler", "Helm chart", "plain manifests")
FEATURES = ("deep idle", "MPS", "multi-GPU", "metrics", "sidebar", "hub auth")


def table() -> dict[str, dict[str, str]]:
    """feature (the row's first words) -> deployment -> cell, from the first table whose header
    names the four deployments and whose rows start with the features above."""
    text = README.read_text()
    header = "| feature | " + " | ".join(DEPLOYMENTS) + " |"
    start = text.index(header)
    rows: dict[str, dict[str, str]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        name = next((f for f in FEATURES if cells[0].startswith(f)), None)
        if name is None:
            break
        rows[name] = dict(zip(DEPLOYMENTS, cells[1:], strict=True))
    return rows


# -- what each deployment is, read from its files ------------------------------------------------


def unit() -> dict[str, list[str]]:
    from tests.deploy.test_systemd import service

    return service()


def chart_daemonset() -> dict[str, Any]:
    result = helm_sdk.run_helm(CHART, {"renders": [{"values": {}, "namespace": "jhub"}]})
    [render] = result["renders"]
    assert "error" not in render, render
    docs = [d for d in yaml.safe_load_all(render["manifest"]) if d]
    return {"objects": docs, "daemonset": next(d for d in docs if d["kind"] == "DaemonSet")}


def plain_daemonset() -> dict[str, Any]:
    paths = [p for p in KUBE.rglob("*.yaml") if p.parent.name != "time-slicing"]
    docs = [d for p in paths for d in yaml.safe_load_all(p.read_text())
            if isinstance(d, dict) and "kind" in d]  # fmt: skip
    return {"objects": docs, "daemonset": next(d for d in docs if d["kind"] == "DaemonSet")}


def container(rendered: dict[str, Any], name: str) -> dict[str, Any] | None:
    spec = rendered["daemonset"]["spec"]["template"]["spec"]
    return next((c for c in spec["containers"] if c["name"] == name), None)


def arg(c: dict[str, Any], option: str) -> str | None:
    return next((a.split("=", 1)[1] for a in c["args"] if a.startswith(f"{option}=")), None)


def k8s_deep_idle(rendered: dict[str, Any]) -> bool:
    c = container(rendered, "scheduler")
    assert c is not None
    env = {e["name"]: e.get("value") for e in c["env"]}
    caps = c["securityContext"]["capabilities"].get("add", [])
    seconds = float(arg(c, "--GPUShareScheduler.deep_idle_seconds") or 600)
    checkpoint_others = {"SYS_PTRACE", "DAC_OVERRIDE"} <= set(caps)
    return seconds > 0 and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"] and checkpoint_others


def k8s_mps(rendered: dict[str, Any]) -> bool:
    c = container(rendered, "scheduler")
    assert c is not None
    schema = json.loads((CHART / "values.schema.json").read_text())
    refused = schema["properties"]["scheduler"]["properties"]["extraArgs"]["items"]["not"]
    return any("mps" in a for a in c["args"]) or not re.match(refused["pattern"], "--mps")


def k8s_multi_gpu(rendered: dict[str, Any]) -> bool:
    plugin = container(rendered, "device-plugin")
    return plugin is not None and bool(arg(plugin, "--nfd-features-dir"))


def k8s_metrics(rendered: dict[str, Any]) -> bool:
    c = container(rendered, "scheduler")
    assert c is not None
    kinds = {d["kind"] for d in rendered["objects"]}
    return bool(arg(c, "--metrics-port")) and {"ServiceMonitor", "PrometheusRule"} <= kinds


def k8s_hub_auth(rendered: dict[str, Any]) -> bool:
    c = container(rendered, "scheduler")
    assert c is not None
    return bool(arg(c, "--user-key")) and bool(arg(c, "--GPUShareScheduler.token_uids"))


def user_image_has_the_sidebar() -> bool:
    dockerfile = (KUBE / "images" / "Dockerfile").read_text()
    stage = dockerfile.split("AS singleuser", 1)[1].split("FROM ", 1)[0]
    return "/wheels/*.whl" in stage and (ROOT / "labextension" / "package.json").exists()


DERIVE: dict[str, dict[str, Callable[[dict[str, Any]], bool]]] = {
    "deep idle": {
        "embedded": lambda _: GPUShareScheduler().deep_idle_seconds > 0,
        # The scheduler loads libcuda for the agents' calls: the unit must let cuInit open
        # the driver's devices (tests/deploy/test_systemd.py checks which).
        "systemd node scheduler": lambda _: (
            "char-nvidia-uvm rw" in unit()["DeviceAllow"]
            and "deep_idle_seconds=0" not in unit()["ExecStart"][0]
        ),
        "Helm chart": k8s_deep_idle,
        "plain manifests": k8s_deep_idle,
    },
    "MPS": {
        "embedded": lambda _: GPUShareScheduler.class_traits().get("mps") is not None,
        "systemd node scheduler": lambda _: "--mps" in unit()["ExecStart"][0],
        "Helm chart": k8s_mps,
        "plain manifests": k8s_mps,
    },
    "multi-GPU": {
        "embedded": lambda _: (ROOT / "jupyter_gpushare/scheduler/features/placement.py").exists(),
        "systemd node scheduler": lambda _: "char-nvidia rw" in unit()["DeviceAllow"],
        "Helm chart": k8s_multi_gpu,
        "plain manifests": k8s_multi_gpu,
    },
    "metrics": {
        "embedded": lambda _: (ROOT / "jupyter_gpushare/scheduler/shell/metrics.py").exists(),
        "systemd node scheduler": lambda _: "AF_INET" in unit()["RestrictAddressFamilies"][0],
        "Helm chart": k8s_metrics,
        "plain manifests": k8s_metrics,
    },
    "sidebar": {
        "embedded": lambda _: (ROOT / "labextension" / "package.json").exists(),
        "systemd node scheduler": lambda _: (ROOT / "labextension" / "package.json").exists(),
        "Helm chart": lambda _: user_image_has_the_sidebar(),
        "plain manifests": lambda _: user_image_has_the_sidebar(),
    },
    "hub auth": {
        "embedded": lambda _: bool(GPUShareScheduler().token_uids),
        "systemd node scheduler": lambda _: (
            "GPUSHARE_SERVICE_USER=gpushare" in unit()["Environment"]
        ),
        "Helm chart": k8s_hub_auth,
        "plain manifests": k8s_hub_auth,
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, Any]]:
    chart = chart_daemonset()
    return {"Helm chart": chart, "plain manifests": plain_daemonset()}


@pytest.mark.parametrize("feature", FEATURES)
def test_each_cell_says_what_the_deployment_gets(
    feature: str, rendered: dict[str, dict[str, Any]]
) -> None:
    cells = table()
    assert set(cells) == set(FEATURES), sorted(cells)
    for deployment in DEPLOYMENTS:
        cell = cells[feature][deployment]
        word = cell.split(":")[0].split(",")[0].strip()
        assert word in ("yes", "no"), f"{feature} / {deployment}: {cell!r} starts with neither"
        has = DERIVE[feature][deployment](rendered.get(deployment, {}))
        assert (word == "yes") == has, f"{feature} / {deployment}: the docs say {cell!r}"
