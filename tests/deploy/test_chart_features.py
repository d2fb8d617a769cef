"""What the chart gives each feature, through the real Helm (tests/deploy/helm_render.py): deep
idle's driver library and capability, the users config checked at render, the Pod Security and
GPU-operator reminders, the NetworkPolicy on the metrics port, `helm test`, the packaged chart,
and one version everywhere (chart, appVersion, images, the package, the conda recipe, the
CHANGELOG)."""

from __future__ import annotations

import re
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from jupyter_gpushare import _version
from jupyter_gpushare.scheduler.features.checkpoint import (
    CAP_DAC_OVERRIDE,
    CAP_SYS_PTRACE,
    may_checkpoint,
)
from tests.deploy import helm_sdk

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "jupyter-gpushare"
NAMESPACE, RELEASE = "jhub", "gpushare"
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "deep idle off": {"scheduler": {"deepIdleSeconds": 0}},
    "no network policy": {"networkPolicy": {"enabled": False}},
}


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    package_dir = tmp_path_factory.mktemp("package")
    jobs = {
        "package": str(package_dir),
        "renders": [{"values": v, "namespace": NAMESPACE, "release": RELEASE}
                    for v in VARIANTS.values()],
    }  # fmt: skip
    result = helm_sdk.run_helm(CHART, jobs)
    out: dict[str, Any] = {"package": result["package"]}
    for name, render in zip(VARIANTS, result["renders"], strict=True):
        assert "error" not in render, (name, render["error"])
        out[name] = render
    return out


def objects(render: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(render["manifest"]) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def scheduler(render: dict[str, Any]) -> dict[str, Any]:
    [ds] = [o for (k, _), o in objects(render).items() if k == "DaemonSet"]
    [c] = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "scheduler"]
    return dict(c)


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def deep_idle_seconds(container: dict[str, Any]) -> float:
    [arg] = [a for a in container["args"] if a.startswith("--GPUShareScheduler.deep_idle_seconds=")]
    return float(arg.split("=", 1)[1])


def test_deep_idle_gets_the_driver_library_and_the_capability_it_needs(
    renders: dict[str, Any],
) -> None:
    """The scheduler checkpoints kernels of uid 1000 as a root without capabilities: the driver
    (checking as ptrace does, then opening what the kernel holds) refuses unless CAP_SYS_PTRACE
    and CAP_DAC_OVERRIDE are both there (each alone gave 304 on an H200: docs/gpu-verification.md,
    2026-12-02 (d)), and without the compute capability the NVIDIA runtime injects no
    libcuda.so.1 ("deep idle is off: cannot load")."""
    on = scheduler(renders["defaults"])
    assert deep_idle_seconds(on) > 0
    assert set(env(on)["NVIDIA_DRIVER_CAPABILITIES"].split(",")) == {"compute", "utility"}
    caps = on["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"] and caps["add"] == ["SYS_PTRACE", "DAC_OVERRIDE"]
    assert on["securityContext"]["runAsUser"] == 0
    # The scheduler's own rule agrees: with exactly those capabilities it checkpoints uid 1000's
    # kernels itself; with one of them, or none (deep idle off), it does not try.
    both = (1 << CAP_SYS_PTRACE) | (1 << CAP_DAC_OVERRIDE)
    assert may_checkpoint(1000, own_euid=0, own_caps=both)
    assert not may_checkpoint(1000, own_euid=0, own_caps=1 << CAP_SYS_PTRACE)
    assert not may_checkpoint(1000, own_euid=0, own_caps=1 << CAP_DAC_OVERRIDE)
    assert not may_checkpoint(1000, own_euid=0, own_caps=0)
    off = scheduler(renders["deep idle off"])
    assert deep_idle_seconds(off) == 0
    assert env(off)["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "add" not in off["securityContext"]["capabilities"]


def test_a_users_config_that_is_not_toml_fails_the_install() -> None:
    bad = "[defaults\nquota = 40GiB"
    result = helm_sdk.run_helm(CHART, {"renders": [{"values": {"usersConfig": bad}}]})
    [render] = result["renders"]
    assert "error" in render and "usersConfig is not valid TOML" in render["error"], render


def test_notes_remind_of_pod_security_and_the_gpu_operator() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "pod-security.kubernetes.io/enforce=privileged" in notes
    assert "GPU operator" in notes and "runtimeClassName" in notes


def test_only_prometheus_reaches_the_metrics_port(renders: dict[str, Any]) -> None:
    objs = objects(renders["defaults"])
    [policy] = [o for (k, _), o in objs.items() if k == "NetworkPolicy"]
    [ds] = [o for (k, _), o in objs.items() if k == "DaemonSet"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    [peer] = rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert not [k for k, _ in objects(renders["no network policy"]) if k == "NetworkPolicy"]


def test_helm_test_asks_a_nodes_scheduler_for_its_status(renders: dict[str, Any]) -> None:
    [hook] = renders["defaults"]["hooks"]
    pod = yaml.safe_load(hook)
    assert pod["kind"] == "Pod"
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [c] = pod["spec"]["containers"]
    socket = next(a for a in scheduler(renders["defaults"])["args"] if a.startswith("--socket="))
    assert c["command"] == ["gpushare", "status", socket]
    assert c["image"] == scheduler(renders["defaults"])["image"]
    [vol] = pod["spec"]["volumes"]
    assert vol["hostPath"]["path"] + "/scheduler.sock" == socket.split("=", 1)[1]


def test_the_chart_packages_into_an_installable_archive(
    renders: dict[str, Any], tmp_path: Path
) -> None:
    """`helm package` through the same library: jupyter-gpushare-VERSION.tgz with the schema,
    the templates and the test hook, and `helm install` takes the archive."""
    package = renders["package"]
    assert "error" not in package, package
    archive = Path(package["path"])
    assert archive.name == f"jupyter-gpushare-{_version.__version__}.tgz"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    members = ("Chart.yaml", "values.yaml", "values.schema.json", "templates/daemonset.yaml",
               "templates/tests/scheduler-answers.yaml", "dashboards/gpushare.json")  # fmt: skip
    for member in members:
        assert f"jupyter-gpushare/{member}" in names, member
    result = helm_sdk.run_helm(archive, {"renders": [{"values": {}}]})
    [render] = result["renders"]
    assert render.get("status") == "deployed", render


def test_one_version_everywhere() -> None:
    """The chart, its appVersion, the image tags, the package, the conda recipe and the
    CHANGELOG's newest section name one release."""
    version = _version.__version__
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version
    dockerfile = (ROOT / "deploy" / "kubernetes" / "images" / "Dockerfile").read_text()
    assert f"ARG GPUSHARE_VERSION={version}\n" in dockerfile
    assert set(re.findall(r":(\d+\.\d+\.\d+) \.", dockerfile)) == {version}
    for values in ("deploy/helm/z2jh-values.yaml", "deploy/kubernetes/z2jh-values.yaml"):
        doc = yaml.safe_load((ROOT / values).read_text())
        assert doc["hub"]["image"]["tag"] == doc["singleuser"]["image"]["tag"] == version
    meta = (ROOT / "deploy" / "conda" / "meta.yaml").read_text()
    assert f'{{% set version = "{version}" %}}' in meta
    changelog = (ROOT / "CHANGELOG.md").read_text()
    [newest] = re.findall(r"^## (.*)$", changelog, re.M)[:1]
    assert version in newest, newest
    for doc in ("docs/operators/helm.md", "docs/install.md"):
        mentioned = set(re.findall(r"(?:scheduler:|jupyter_gpushare-)(\d+\.\d+\.\d+)",
                                   (ROOT / doc).read_text()))  # fmt: skip
        assert mentioned <= {version}, (doc, mentioned)


def test_the_conda_recipe_constrains_the_k8s_extra() -> None:
    """conda has no extras: the device plugin's gRPC packages are run_constrained at the
    pyproject k8s extra's bounds, so a node that installs them gets compatible ones."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = {
        re.split(r"[<>=!; ]", r)[0]: r for r in pyproject["project"]["optional-dependencies"]["k8s"]
    }
    text = (ROOT / "deploy" / "conda" / "meta.yaml").read_text()
    constrained = text.split("run_constrained:")[1].split("\n\n")[0]
    for name, req in extra.items():
        bounds = req[len(name) :].replace(" ", "")
        assert re.search(rf"- {re.escape(name)} {re.escape(bounds)}$", constrained, re.M), req


def test_the_device_plugin_labels_nodes_by_their_largest_gpu(renders: dict[str, Any]) -> None:
    """Kubernetes counts a node's units, not each GPU's: the plugin writes NFD's feature file
    (a writable hostPath) whose label profiles use to avoid nodes where no GPU can hold them;
    docs/operators/multi-gpu.md names that label."""
    from jupyter_gpushare.deviceplugin.node_features import LABEL_PREFIX, LARGEST_GPU

    [ds] = [o for (k, _), o in objects(renders["defaults"]).items() if k == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    [plugin] = [c for c in spec["containers"] if c["name"] == "device-plugin"]
    [arg] = [a for a in plugin["args"] if a.startswith("--nfd-features-dir=")]
    directory = arg.split("=", 1)[1]
    [mount] = [m for m in plugin["volumeMounts"] if m["mountPath"] == directory]
    assert not mount.get("readOnly")
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"]["path"] == directory
    assert directory.endswith("node-feature-discovery/features.d")
    docs = (ROOT / "docs" / "operators" / "multi-gpu.md").read_text()
    assert f"{LABEL_PREFIX}{LARGEST_GPU}" in docs and "operator: Gt" in docs


def test_helm_md_lists_every_value() -> None:
    """The values table of docs/operators/helm.md names every value values.yaml has (maps of
    the user's own, such as resources or labels, as one value)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = (ROOT / "docs" / "operators" / "helm.md").read_text()
    rows = text.split("### Values", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([a-zA-Z.]+)`", rows))

    def leaves(doc: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, value in doc.items():
            if isinstance(value, dict) and value and key not in ("resources", "labels",
                                                                  "nodeSelector"):  # fmt: skip
                out += leaves(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}")
        return out

    missing = [name for name in leaves(values) if name not in listed]
    assert not missing, missing
