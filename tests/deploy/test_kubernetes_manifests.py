"""deploy/kubernetes, checked without a cluster: every manifest against the Kubernetes schemas
(kubernetes-validate's bundled, offline, strict schemas: unknown fields are errors), the pod-spec
fragments of the Zero to JupyterHub values wrapped into Pods and checked the same way, and the
pieces against each other (socket path, Secret, ports, labels, uid, images, the hub's config)."""

from __future__ import annotations

import copy
import os
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from traitlets.config import Config

from jupyter_gpushare import _version, hub
from jupyter_gpushare.identity import generate_key, load_key, user_token
from jupyter_gpushare.scheduler.shell.users import load_users_config

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
#: The oldest and a recent Kubernetes version we promise to fit (bundled in kubernetes-validate).
VERSIONS = ("1.30.0", "1.34.0")
#: Manifests applied by kustomization.yaml; the monitoring objects are in monitoring/ (CRDs).
MANIFESTS = ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "users-config.yaml",
             "daemonset.yaml", "service.yaml", "networkpolicy.yaml")  # fmt: skip
MONITORING = ("monitoring/servicemonitor.yaml", "monitoring/prometheusrule.yaml",
              "monitoring/dashboard-configmap.yaml")  # fmt: skip
SOCKET = "/run/gpushare/scheduler.sock"
#: The overlays of z2jh-values.yaml for the layouts without gpushare's device plugin.
TIME_SLICING, DEDICATED = "z2jh-values-time-slicing.yaml", "z2jh-values-dedicated-pool.yaml"


def load_all(name: str) -> list[dict[str, Any]]:
    with open(KUBE / name) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load(name: str) -> dict[str, Any]:
    [doc] = load_all(name)
    return doc


def validate(resource: dict[str, Any]) -> None:
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(
                f"{resource['kind']} {resource['metadata'].get('name')}: Kubernetes {version} "
                f"schema: {where}: {exc.message}",
                pytrace=False,
            )


def daemonset() -> dict[str, Any]:
    return load("daemonset.yaml")


def scheduler_container() -> dict[str, Any]:
    containers = daemonset()["spec"]["template"]["spec"]["containers"]
    [container] = [c for c in containers if c["name"] == "scheduler"]
    return dict(container)


def scheduler_options() -> dict[str, str]:
    """The DaemonSet's ``gpushare scheduler`` options, ``--name=value`` as a dict."""
    args = scheduler_container()["args"]
    assert args[0] == "scheduler", args
    out = {}
    for arg in args[1:]:
        assert arg.startswith("--") and "=" in arg, f"write options as --name=value: {arg!r}"
        name, value = arg[2:].split("=", 1)
        out[name] = value
    return out


def helm_merge(base: Any, overlay: Any) -> Any:
    """Helm's merge of values files: maps merge deeply, null deletes a key, the rest replaces."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = copy.deepcopy(base)
        for key, value in overlay.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = helm_merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    return copy.deepcopy(overlay)


def env_list(env: dict[str, Any]) -> list[dict[str, Any]]:
    """z2jh's extraEnv (a map of name to a value or to an EnvVar's other fields) as EnvVars."""
    out = []
    for name, value in env.items():
        if isinstance(value, dict):
            out.append({"name": name, **value})
        else:
            assert isinstance(value, str), f"{name}: z2jh wants strings, got {value!r}"
            out.append({"name": name, "value": value})
    return out


def values(*overlays: str) -> dict[str, Any]:
    doc = load("z2jh-values.yaml")
    for name in overlays:
        doc = helm_merge(doc, load(name))
    return doc


def user_pod(vals: dict[str, Any]) -> dict[str, Any]:
    """The parts of KubeSpawner's user pod that the values set, as a Pod."""
    su = vals["singleuser"]
    container: dict[str, Any] = {
        "name": "notebook",
        "image": f"{su['image']['name']}:{su['image']['tag']}",
        "env": env_list(su.get("extraEnv", {})),
        "volumeMounts": su.get("storage", {}).get("extraVolumeMounts", []),
        "securityContext": {"runAsUser": su["uid"]},
    }
    limits = su.get("extraResource", {}).get("limits") or {}
    if limits:
        container["resources"] = {"limits": limits}
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": su.get("storage", {}).get("extraVolumes", []),
        "tolerations": su.get("extraTolerations", []),
        "nodeSelector": su.get("nodeSelector", {}),
        **su.get("extraPodConfig", {}),
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "jupyter-alice"}, "spec": spec}


def hub_pod(vals: dict[str, Any]) -> dict[str, Any]:
    h = vals["hub"]
    container = {
        "name": "hub",
        "image": f"{h['image']['name']}:{h['image']['tag']}",
        "env": env_list(h.get("extraEnv", {})),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hub"},
        "spec": {"containers": [container]},
    }


# -- schemas -----------------------------------------------------------------------------------


def test_the_schemas_are_bundled_offline() -> None:
    """kubernetes-validate ships each version's JSON schemas in the package: no network."""
    for version in VERSIONS:
        assert version in kubernetes_validate.utils.all_versions(), version


@pytest.mark.parametrize("name", [*MANIFESTS, "monitoring/dashboard-configmap.yaml"])
def test_manifest_fits_the_kubernetes_schema(name: str) -> None:
    docs = load_all(name)
    assert docs, name
    for doc in docs:
        validate(doc)


def test_a_wrong_field_is_caught() -> None:
    """The check bites: a typo in the DaemonSet fails strict validation."""
    ds = daemonset()
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlays", [(), (TIME_SLICING,), (TIME_SLICING, DEDICATED)], ids=str)
def test_z2jh_pod_fragments_fit_the_pod_schema(overlays: tuple[str, ...]) -> None:
    vals = values(*overlays)
    validate(user_pod(vals))
    validate(hub_pod(vals))


def test_servicemonitor_selects_the_metrics_service() -> None:
    sm = load("monitoring/servicemonitor.yaml")  # a CRD's object: no bundled schema; by hand
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    svc = load("service.yaml")
    labels = svc["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]


# -- consistency -------------------------------------------------------------------------------


def test_the_generated_manifests_are_the_charts() -> None:
    """Every manifest but namespace.yaml is what the chart renders (through the Helm library the
    chart's tests use) with values.yaml: regenerate with tests/deploy/render_manifests.py."""
    from tests.deploy.render_manifests import PLAIN_RULES, render

    rendered = render()
    stale = [str(p) for p, text in rendered.items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run tests/deploy/render_manifests.py: stale {stale}"
    generated = {str(p.relative_to(KUBE)) for p in KUBE.rglob("*.yaml")
                 if p.read_text().startswith("# GENERATED from deploy/helm")}  # fmt: skip
    assert generated == set(MANIFESTS[1:]) | set(MONITORING)
    assert PLAIN_RULES in rendered
    kinds = {d["kind"] for n in MANIFESTS + MONITORING for d in load_all(n)}
    assert {"DaemonSet", "ServiceMonitor", "PrometheusRule", "Role"} <= kinds
    containers = {c["name"] for c in daemonset()["spec"]["template"]["spec"]["containers"]}
    assert containers == {"scheduler", "device-plugin"}


def test_kustomization_lists_the_manifests() -> None:
    k = load("kustomization.yaml")
    assert tuple(k["resources"]) == MANIFESTS
    monitoring = load("monitoring/kustomization.yaml")
    assert tuple(f"monitoring/{r}" for r in monitoring["resources"]) == MONITORING
    assert monitoring["namespace"] == k["namespace"]
    for name in MANIFESTS:
        for doc in load_all(name):
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == k["namespace"], (name, doc["kind"])
    [image] = k["images"]
    assert scheduler_container()["image"] == f"{image['name']}:{image['newTag']}"


def test_one_version_everywhere() -> None:
    """The shim (user image) and the scheduler speak one protocol version: same release."""
    version = _version.__version__
    assert scheduler_container()["image"].endswith(f":{version}")
    assert load("kustomization.yaml")["images"][0]["newTag"] == version
    vals = values()
    assert vals["singleuser"]["image"]["tag"] == version
    assert vals["hub"]["image"]["tag"] == version


def test_socket_path_is_the_same_for_the_scheduler_and_the_user_pods() -> None:
    opts = scheduler_options()
    assert opts["socket"] == SOCKET
    pod = daemonset()["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in scheduler_container()["volumeMounts"]}
    assert mounts["socket-dir"]["mountPath"] == os.path.dirname(SOCKET)
    host_dir = vols["socket-dir"]["hostPath"]["path"]

    su = values(TIME_SLICING)["singleuser"]  # a plugin pod gets its own from Allocate
    assert su["extraEnv"]["GPUSHARE_SOCKET"] == SOCKET
    assert su["extraEnv"]["GPUSHARE_SCHEDULER"] == "node"
    [uvol] = [v for v in su["storage"]["extraVolumes"] if "hostPath" in v]
    [umount] = [m for m in su["storage"]["extraVolumeMounts"] if m["name"] == uvol["name"]]
    assert uvol["hostPath"]["path"] == host_dir
    assert umount["mountPath"] == os.path.dirname(SOCKET)
    assert umount.get("readOnly") is True, "a writable socket directory lets a user fake it"
    # The hub's hook sets the same socket.
    assert f'socket="{SOCKET}"' in values()["hub"]["extraConfig"]["gpushare"]


def test_user_key_secret_is_the_same_for_the_scheduler_and_the_hub() -> None:
    pod = daemonset()["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in scheduler_container()["volumeMounts"]}
    secret = vols["user-key"]["secret"]
    key_path = scheduler_options()["user-key"]
    # Mounted as a file of its own (subPath): a Secret volume's entries are symlinks, and the
    # key is opened without following links.
    assert mounts["user-key"]["mountPath"] == key_path
    assert mounts["user-key"]["subPath"] == "user.key"
    assert secret["defaultMode"] == 0o400, "the key must be readable by its owner only"
    ref = values()["hub"]["extraEnv"]["GPUSHARE_USER_KEY"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["secretName"], mounts["user-key"]["subPath"])


def test_user_pods_uid_is_a_token_uid() -> None:
    uid = int(scheduler_options()["GPUShareScheduler.token_uids"])
    assert values()["singleuser"]["uid"] == uid


def test_metrics_port_matches_the_service() -> None:
    opts = scheduler_options()
    port = int(opts["metrics-port"])
    assert opts["metrics-address"] == "0.0.0.0"
    [cport] = scheduler_container()["ports"]
    assert cport["containerPort"] == port
    svc = load("service.yaml")
    [sport] = svc["spec"]["ports"]
    assert sport["targetPort"] == cport["name"] and sport["port"] == port
    pod_labels = daemonset()["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert daemonset()["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ready = scheduler_container()["readinessProbe"]["httpGet"]
    assert ready["port"] == cport["name"]


def test_probes_ask_the_scheduler_on_its_socket() -> None:
    c = scheduler_container()
    for probe in ("startupProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:2] == ["gpushare", "status"], cmd
        assert f"--socket={SOCKET}" in cmd, cmd


def test_users_config_in_the_configmap_loads(tmp_path: Path) -> None:
    cm = load("users-config.yaml")
    opts = scheduler_options()
    mounts = {m["name"]: m for m in scheduler_container()["volumeMounts"]}
    path = opts["users-config"]
    assert os.path.dirname(path) == mounts["users-config"]["mountPath"]
    text = cm["data"][os.path.basename(path)]
    (tmp_path / "users.toml").write_text(text)
    load_users_config(str(tmp_path / "users.toml"))  # raises with the key on a bad file


def test_every_kernel_runs_under_gpushare() -> None:
    """The user pods' server config: the gpushare provisioner for every kernel (by its entry
    point's name) and the shipped "(GPU shared)" kernelspec as the default kernel."""
    from importlib.metadata import entry_points

    files = values()["singleuser"]["extraFiles"]
    [entry] = files.values()
    assert entry["mountPath"].startswith("/etc/jupyter/jupyter_server_config.d/")
    assert entry["mountPath"].endswith(".json")  # z2jh writes data as JSON for .json
    data = entry["data"]
    provisioner = data["KernelProvisionerFactory"]["default_provisioner_name"]
    names = {e.name for e in entry_points(group="jupyter_client.kernel_provisioners")}
    assert provisioner in names, names
    name = data["MultiKernelManager"]["default_kernel_name"]
    assert (ROOT / "jupyter-data" / "kernels" / name / "kernel.json").exists(), name


def test_hub_extra_config_installs_the_token_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run the values' hub.extraConfig as the hub would, with a key in GPUSHARE_USER_KEY."""
    key_file = tmp_path / "user.key"
    generate_key(str(key_file))
    monkeypatch.setenv("GPUSHARE_USER_KEY", key_file.read_text())
    c = Config()
    for name, code in values()["hub"]["extraConfig"].items():
        exec(compile(code, f"hub.extraConfig.{name}", "exec"), {"c": c, "get_config": lambda: c})
    hook = c.Spawner.pre_spawn_hook
    assert isinstance(hook, hub.TokenHook)

    class Spawner:
        user = type("User", (), {"name": "alice"})()
        environment = values(TIME_SLICING)["singleuser"]["extraEnv"]  # KubeSpawner's

    spawner = Spawner()
    hook(spawner)
    env = spawner.environment
    assert env["GPUSHARE_USER"] == "alice"
    assert env["GPUSHARE_USER_TOKEN"] == user_token(load_key(str(key_file)), "alice")
    assert env["GPUSHARE_SOCKET"] == SOCKET


def test_dockerfile_builds_the_images_the_manifests_name() -> None:
    text = (KUBE / "images" / "Dockerfile").read_text()
    targets = {line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")}
    images = {
        scheduler_container()["image"]: "scheduler",
        f"{values()['singleuser']['image']['name']}:{_version.__version__}": "singleuser",
        f"{values()['hub']['image']['name']}:{_version.__version__}": "hub",
    }
    for image, target in images.items():
        assert target in targets, target
        assert any(
            shlex.split(line)[-3:-1] == ["-t", image] and f"--target {target}" in line
            for line in text.splitlines()
            if "docker build" in line
        ), f"no build line for {image} (target {target})"


def test_the_scheduler_accepts_the_daemonsets_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The DaemonSet's options are ones `gpushare scheduler` knows, with valid values."""
    from jupyter_gpushare.cli import SchedulerApp
    from jupyter_gpushare.scheduler.shell.server import GPUShareScheduler

    c = scheduler_container()
    assert c["command"] == ["gpushare"]
    app = SchedulerApp()
    app.parse_command_line(c["args"][1:])
    sched = GPUShareScheduler(parent=app)
    assert sched.socket_path == SOCKET
    assert sched.user_key_file == "/etc/gpushare/user.key"
    assert list(sched.token_uids) == [values()["singleuser"]["uid"]]
    assert sched.metrics_port == c["ports"][0]["containerPort"]
    assert app.log_style == "json"
    # The check above would pass for any list if the parser took anything: an unknown option
    # is refused with a usage error (exit status 2, the option named on stderr).
    with pytest.raises(SystemExit) as refused:
        SchedulerApp().parse_command_line(["--no-such-option=1"])
    assert refused.value.code == 2
    assert "unknown option --no-such-option" in capsys.readouterr().err


def test_kustomize_renders_the_same_objects() -> None:
    """`kubectl kustomize` (where kubectl is installed: it needs no cluster) builds exactly the
    manifests checked above, with octal modes read as octal (0400 is 256, not 400)."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the schema checks above do not need it)")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout)}
    expected = {(d["kind"], d["metadata"]["name"]): d for n in MANIFESTS for d in load_all(n)}
    assert rendered == expected
