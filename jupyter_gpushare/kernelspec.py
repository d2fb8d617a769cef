"""``jupyter gpushare``: kernelspecs whose kernels run under the GPU-sharing shim.

    jupyter gpushare install-kernelspec [--user | --sys-prefix | --prefix P] [--name NAME ...]
                                        [--memory-limit 8GiB] [--weight 2]
    jupyter gpushare list-kernelspecs [--json]
    jupyter gpushare remove-kernelspec [--user | --sys-prefix | --prefix P] [--name NAME ...]
                                       [--force]

``install-kernelspec`` writes a "(GPU shared)" variant ``<name>-gpushare`` of each installed
kernelspec (or of those named with ``--name``): the same ``argv``, ``env``, language and logos, plus

    "metadata": {"kernel_provisioner": {"provisioner_name": "gpushare-provisioner",
                                        "config": {"memory_limit": "8GiB", "weight": 2.0}}}

Running it again rewrites the variants (idempotent: the same options give the same files; new
options update them). Variants are never made of variants, nor of kernelspecs that already name
another provisioner.

Site-wide, without variants
---------------------------
To run *every* kernel of a Jupyter server under the shim, make the provisioner the default instead
of installing variants (kernelspecs that name a provisioner of their own keep it)::

    # jupyter_server_config.py (or jupyterhub's singleuser config)
    c.KernelProvisionerFactory.default_provisioner_name = "gpushare-provisioner"
    c.GPUShareProvisioner.memory_limit = "16GiB"   # optional: a default quota per kernel
    c.GPUShareProvisioner.weight = 1.0

The ``jupyter-gpushare`` script makes this ``jupyter gpushare`` (Jupyter finds ``jupyter-<name>``
commands on ``PATH``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_core.application import JupyterApp, base_aliases, base_flags
from traitlets import Bool, Float, Instance, List, Unicode, validate

from ._version import __version__
from .provisioner import PROVISIONER_NAME
from .units import parse_size

__all__ = [
    "GPUShareKernelspecApp",
    "InstallKernelspecApp",
    "ListKernelspecsApp",
    "RemoveKernelspecApp",
    "is_gpushare_spec",
    "main",
    "make_variant",
]

DEFAULT_SUFFIX = "-gpushare"
DISPLAY_SUFFIX = " (GPU shared)"
#: The variants' logos (the launcher and the notebook's kernel indicator show them), drawn for
#: gpushare: logo-svg.svg is the source of the two PNGs.
LOGOS = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")
#: The package's own kernelspec (jupyter-data/kernels/python3-gpushare in the source tree; the
#: wheel installs it into share/jupyter/kernels/): the one place the logos are kept.
SHIPPED_KERNELSPEC = "python3-gpushare"
SOURCE_KERNELSPEC = (
    Path(__file__).resolve().parents[1] / "jupyter-data" / "kernels" / SHIPPED_KERNELSPEC
)


def logo_dir() -> Path | None:
    """Where the logos are: the source tree's kernelspec (a checkout, an editable install), else
    the installed python3-gpushare kernelspec wherever Jupyter looks for kernelspecs (the wheel
    ships the logos once, there). None when neither has them (that kernelspec was removed)."""
    from jupyter_core.paths import jupyter_path

    candidates = [SOURCE_KERNELSPEC]
    candidates += [Path(d) / SHIPPED_KERNELSPEC for d in jupyter_path("kernels")]
    for d in candidates:
        if all((d / logo).is_file() for logo in LOGOS):
            return d
    return None


#: The mark in a variant's metadata that install-kernelspec made it: remove-kernelspec removes only
#: such variants unless forced (the package's own python3-gpushare, installed by pip, has none).
MADE_BY_KEY = "gpushare_made_by"
MADE_BY = "jupyter gpushare install-kernelspec"
#: Resource files of a kernelspec that are not copied into its variant.
_SKIP_FILES = {"kernel.json", "__pycache__"}


class KernelspecError(Exception):
    """A problem the user must fix; its text is printed as is."""


def _provisioner(spec: dict[str, Any]) -> dict[str, Any] | None:
    metadata = spec.get("metadata") or {}
    prov = metadata.get("kernel_provisioner")
    return prov if isinstance(prov, dict) else None


def is_gpushare_spec(spec: dict[str, Any]) -> bool:
    """Whether a kernel.json document launches its kernels through the gpushare provisioner."""
    prov = _provisioner(spec)
    return bool(prov and prov.get("provisioner_name") == PROVISIONER_NAME)


def made_here(spec: dict[str, Any]) -> bool:
    """Whether install-kernelspec wrote this kernel.json document (see MADE_BY_KEY)."""
    return bool((spec.get("metadata") or {}).get(MADE_BY_KEY) == MADE_BY)


def make_variant(
    spec: dict[str, Any], config: dict[str, Any], display_suffix: str = DISPLAY_SUFFIX
) -> dict[str, Any]:
    """The kernel.json document of ``spec``'s GPU-shared variant."""
    out = json.loads(json.dumps(spec))  # a deep copy that stays JSON
    display = str(out.get("display_name") or "")
    if not display.endswith(display_suffix):
        out["display_name"] = display + display_suffix
    metadata = dict(out.get("metadata") or {})
    metadata["kernel_provisioner"] = {"provisioner_name": PROVISIONER_NAME, "config": config}
    out["metadata"] = metadata
    if not out.get("kernel_protocol_version"):
        version = _protocol_version(out.get("argv") or [])
        if version:
            out["kernel_protocol_version"] = version
    return out


def _protocol_version(argv: list[str]) -> str | None:
    """The messaging protocol an ipykernel speaks (its kernelspecs leave the field empty)."""
    from .provisioner import is_ipykernel_argv

    if not is_ipykernel_argv(argv):
        return None
    try:
        from ipykernel._version import kernel_protocol_version
    except ImportError:
        return None
    return str(kernel_protocol_version)


class _KernelspecBase(JupyterApp):
    version = __version__

    kernel_spec_manager = Instance(KernelSpecManager)

    def _kernel_spec_manager_default(self) -> KernelSpecManager:
        # Its own log lines ("Installed kernelspec ...") would repeat what the app prints.
        quiet = logging.getLogger("jupyter_gpushare.kernelspec.manager")
        quiet.setLevel(logging.WARNING)
        return KernelSpecManager(parent=self, data_dir=self.data_dir, log=quiet)

    def fail(self, message: str, code: int = 1) -> None:
        print(f"jupyter {self.name.replace('-', ' ', 1)}: {message}", file=sys.stderr)
        self.exit(code)

    def all_specs(self) -> dict[str, dict[str, Any]]:
        return dict(self.kernel_spec_manager.get_all_specs())


_location_aliases = {
    "prefix": "InstallKernelspecApp.prefix",
    "name": "InstallKernelspecApp.kernel_names",
    "memory-limit": "InstallKernelspecApp.memory_limit",
    "weight": "InstallKernelspecApp.weight",
    "suffix": "InstallKernelspecApp.suffix",
}


class InstallKernelspecApp(_KernelspecBase):
    name = "gpushare-install-kernelspec"
    description = """Install "(GPU shared)" variants of kernelspecs: the same kernels, launched
    through the gpushare provisioner (under libgpushare.so, scheduled by the node's gpushare
    scheduler). Default: a variant of every installed kernelspec, in the system-wide Jupyter
    path; --user, --sys-prefix or --prefix pick another place. Running it again updates the
    variants."""
    examples = """
    jupyter gpushare install-kernelspec --user
    jupyter gpushare install-kernelspec --sys-prefix --name python3 --memory-limit 8GiB
    jupyter gpushare install-kernelspec --prefix /opt/conda --weight 2
    """

    kernel_names = List(
        Unicode(), help="Kernelspecs to make variants of (repeatable). Default: all installed."
    ).tag(config=True)
    user = Bool(False, help="Install for the current user (~/.local/share/jupyter).").tag(
        config=True
    )
    prefix = Unicode("", help="Install under PREFIX/share/jupyter/kernels.").tag(config=True)
    memory_limit = Unicode(
        "", help="Memory quota of each kernel, e.g. 8GiB ('' = none, or the server's default)."
    ).tag(config=True)
    weight = Float(0.0, help="Fair-share weight of each kernel (0 = the server's default).").tag(
        config=True
    )
    suffix = Unicode(DEFAULT_SUFFIX, help="Appended to a kernelspec's name for its variant.").tag(
        config=True
    )
    force = Bool(
        False, help="Replace kernelspecs of the variants' names that this command did not make."
    ).tag(config=True)

    aliases = {**base_aliases, **_location_aliases}
    flags = {
        **base_flags,
        "force": (
            {"InstallKernelspecApp": {"force": True}},
            "Replace kernelspecs of the variants' names that install-kernelspec did not make.",
        ),
        "user": ({"InstallKernelspecApp": {"user": True}}, "Install for the current user."),
        "sys-prefix": (
            {"InstallKernelspecApp": {"prefix": sys.prefix}},
            f"Install into this Python environment ({sys.prefix}).",
        ),
    }

    @validate("memory_limit")
    def _check_memory(self, proposal: Any) -> str:
        value = str(proposal["value"])
        if value:
            try:
                parse_size(value)
            except ValueError as exc:
                raise KernelspecError(f"--memory-limit: {exc}") from None
        return value

    @validate("weight")
    def _check_weight(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if value < 0:
            raise KernelspecError(f"--weight must be positive, got {value:g}")
        return value

    @validate("suffix")
    def _check_suffix(self, proposal: Any) -> str:
        value = str(proposal["value"]).lower()
        if not value:
            raise KernelspecError("--suffix cannot be empty: a variant needs a name of its own")
        return value

    def initialize(self, argv: Any = None) -> None:
        try:
            super().initialize(argv)
        except KernelspecError as exc:
            self.fail(str(exc), 2)

    def provisioner_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {}
        if self.memory_limit:
            config["memory_limit"] = self.memory_limit
        if self.weight:
            config["weight"] = self.weight
        return config

    def sources(self, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The kernelspecs to make variants of."""
        originals = {n: s for n, s in specs.items() if not is_gpushare_spec(s["spec"])}
        if self.kernel_names:
            chosen: dict[str, dict[str, Any]] = {}
            for name in self.kernel_names:
                key = name.lower()
                if key in originals:
                    chosen[key] = originals[key]
                elif key in specs:
                    raise KernelspecError(
                        f"{name!r} is already a GPU-shared kernelspec; name the kernelspec it "
                        "was made from"
                    )
                else:
                    known = ", ".join(sorted(originals)) or "none"
                    raise KernelspecError(
                        f"no kernelspec named {name!r} (installed: {known}; see "
                        "`jupyter kernelspec list`)"
                    )
            return chosen
        return originals

    def start(self) -> None:
        if self.user and self.prefix:
            self.fail("choose one of --user, --sys-prefix and --prefix", 2)
        try:
            self._install()
        except KernelspecError as exc:
            self.fail(str(exc))

    def _refuse_to_replace(self, sources: dict[str, dict[str, Any]]) -> None:
        """Nothing is written while a variant's place holds a kernelspec that this command did
        not make (written by hand, or by pip), unless --force."""
        if self.force:
            return
        taken = []
        for name in sorted(sources):
            destination = Path(
                self.kernel_spec_manager._get_destination_dir(
                    f"{name}{self.suffix}", user=self.user, prefix=self.prefix or None
                )
            )
            if not _made_here_or_absent(destination):
                taken.append(f"{destination.name} ({destination})")
        if taken:
            raise KernelspecError(
                f"not replacing {', '.join(taken)}: `jupyter gpushare install-kernelspec` did not "
                "make it; --force replaces it, --suffix gives the variants other names"
            )

    def _install(self) -> None:
        specs = self.all_specs()
        sources = self.sources(specs)
        if not sources:
            raise KernelspecError(
                "no kernelspecs to make variants of (`jupyter kernelspec list` shows none)"
            )
        config = self.provisioner_config()
        ksm = self.kernel_spec_manager
        logos = logo_dir()
        if logos is None:
            self.log.warning(
                "the %s kernelspec, which has gpushare's logos, is not installed: the variants "
                "keep their kernelspecs' own logos",
                SHIPPED_KERNELSPEC,
            )
        self._refuse_to_replace(sources)
        done = 0
        for name, entry in sorted(sources.items()):
            spec = entry["spec"]
            prov = _provisioner(spec)
            if prov and prov.get("provisioner_name") not in (None, "local-provisioner"):
                self.log.warning(
                    "skipping %s: it is launched by the %r provisioner; gpushare cannot wrap it",
                    name,
                    prov.get("provisioner_name"),
                )
                continue
            variant_name = f"{name}{self.suffix}"
            variant = make_variant(spec, config)
            variant["metadata"][MADE_BY_KEY] = MADE_BY
            destination = ksm._get_destination_dir(
                variant_name, user=self.user, prefix=self.prefix or None
            )
            if _same_spec(Path(destination) / "kernel.json", variant) and (
                logos is None or all((Path(destination) / logo).is_file() for logo in LOGOS)
            ):
                print(f"unchanged: {variant_name} ({variant['display_name']}) in {destination}")
                done += 1
                continue
            with tempfile.TemporaryDirectory(prefix="gpushare-kernelspec-") as tmp:
                staging = Path(tmp) / variant_name
                _copy_resources(Path(entry["resource_dir"]), staging)
                if logos is not None:
                    for logo in LOGOS:
                        shutil.copy2(logos / logo, staging / logo)
                (staging / "kernel.json").write_text(json.dumps(variant, indent=1) + "\n")
                try:
                    path = ksm.install_kernel_spec(
                        str(staging),
                        variant_name,
                        user=self.user,
                        prefix=self.prefix or None,
                    )
                except PermissionError as exc:
                    raise KernelspecError(
                        f"cannot write {destination}: permission denied ({exc.strerror}). Use "
                        "--user (your kernels only), --sys-prefix (this Python environment) or "
                        "--prefix PATH, or run as an administrator for a system-wide install"
                    ) from None
                except OSError as exc:
                    raise KernelspecError(f"cannot install {variant_name}: {exc}") from None
            print(f"installed: {variant_name} ({variant['display_name']}) in {path}")
            done += 1
        if not done:
            raise KernelspecError("no kernelspec could be given a GPU-shared variant")


def _made_here_or_absent(destination: Path) -> bool:
    """Whether install-kernelspec may write ``destination``: nothing there, or a variant it made."""
    if not destination.exists():
        return True
    try:
        return made_here(json.loads((destination / "kernel.json").read_text()))
    except (OSError, ValueError):
        return False


def _same_spec(kernel_json: Path, variant: dict[str, Any]) -> bool:
    try:
        return bool(json.loads(kernel_json.read_text()) == variant)
    except (OSError, ValueError):
        return False


def _copy_resources(source: Path, destination: Path) -> None:
    """Copy a kernelspec's resource files (logos, scripts), not its kernel.json."""
    destination.mkdir(parents=True)
    if not source.is_dir():
        return
    for item in source.iterdir():
        if item.name in _SKIP_FILES:
            continue
        target = destination / item.name
        if item.is_dir():
            shutil.copytree(item, target)
        else:
            shutil.copy2(item, target)


class ListKernelspecsApp(_KernelspecBase):
    name = "gpushare-list-kernelspecs"
    description = """List kernelspecs and whether their kernels run under gpushare (with the
    provisioner configuration of those that do)."""

    json_output = Bool(False, help="Print JSON.").tag(config=True)
    aliases = base_aliases
    flags = {
        **base_flags,
        "json": ({"ListKernelspecsApp": {"json_output": True}}, "Print JSON."),
    }

    def start(self) -> None:
        specs = self.all_specs()
        rows = []
        for name, entry in sorted(specs.items()):
            spec = entry["spec"]
            prov = _provisioner(spec) or {}
            rows.append(
                {
                    "name": name,
                    "display_name": spec.get("display_name", ""),
                    "gpushare": is_gpushare_spec(spec),
                    "config": prov.get("config", {}) if is_gpushare_spec(spec) else None,
                    "resource_dir": entry["resource_dir"],
                }
            )
        if self.json_output:
            print(json.dumps({"kernelspecs": rows}, indent=1))
            return
        if not rows:
            print("No kernelspecs installed.")
            return
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            mark = "gpushare" if r["gpushare"] else "        "
            extra = ""
            if r["gpushare"] and r["config"]:
                extra = " " + ", ".join(f"{k}={v}" for k, v in sorted(r["config"].items()))
            print(f"  {r['name'].ljust(width)}  {mark}  {r['display_name']}{extra}")
            print(f"  {' ' * width}            {r['resource_dir']}")


class RemoveKernelspecApp(_KernelspecBase):
    name = "gpushare-remove-kernelspec"
    description = """Remove the GPU-shared kernelspec variants that `jupyter gpushare
    install-kernelspec` made (all of them, or those named with --name: the variant's name or the
    name of the kernelspec it was made from), from every Jupyter path or only from the place that
    --user, --sys-prefix or --prefix names. Other kernelspecs are never touched; a GPU-shared
    kernelspec that this command did not make (the one pip installs, or one written by hand) is
    removed only with --force."""
    examples = """
    jupyter gpushare remove-kernelspec --user --name myenv
    jupyter gpushare remove-kernelspec --sys-prefix
    """

    kernel_names = List(Unicode(), help="Variants to remove (repeatable). Default: all.").tag(
        config=True
    )
    user = Bool(False, help="Only the current user's kernelspecs.").tag(config=True)
    prefix = Unicode("", help="Only the kernelspecs under PREFIX/share/jupyter/kernels.").tag(
        config=True
    )
    force = Bool(
        False, help="Also remove GPU-shared kernelspecs that install-kernelspec did not make."
    ).tag(config=True)
    aliases = {
        **base_aliases,
        "name": "RemoveKernelspecApp.kernel_names",
        "prefix": "RemoveKernelspecApp.prefix",
    }
    flags = {
        **base_flags,
        "user": ({"RemoveKernelspecApp": {"user": True}}, "Only the current user's kernelspecs."),
        "sys-prefix": (
            {"RemoveKernelspecApp": {"prefix": sys.prefix}},
            f"Only this Python environment's kernelspecs ({sys.prefix}).",
        ),
        "force": (
            {"RemoveKernelspecApp": {"force": True}},
            "Also remove GPU-shared kernelspecs that install-kernelspec did not make.",
        ),
    }

    def candidates(self) -> dict[str, dict[str, Any]]:
        """The kernelspecs to choose from, by directory: every copy in every Jupyter path (also
        those that another of the same name hides, such as a variant install-kernelspec wrote to
        the system-wide place it uses by default), or one place's."""
        if self.user and self.prefix:
            self.fail("choose one of --user, --sys-prefix and --prefix", 2)
        if self.user or self.prefix:
            places = [
                Path(
                    self.kernel_spec_manager._get_destination_dir(
                        "x", user=self.user, prefix=self.prefix
                    )
                ).parent
            ]
        else:
            places = [Path(d) for d in self.kernel_spec_manager.kernel_dirs]
            places.append(Path(self.kernel_spec_manager._get_destination_dir("x")).parent)
        found: dict[str, dict[str, Any]] = {}
        for place in places:
            for kernel_json in sorted(place.glob("*/kernel.json")):
                with contextlib.suppress(OSError, ValueError):
                    spec = json.loads(kernel_json.read_text())
                    found[os.path.realpath(kernel_json.parent)] = {
                        "name": kernel_json.parent.name.lower(),
                        "spec": spec,
                        "resource_dir": str(kernel_json.parent),
                    }
        return found

    def start(self) -> None:
        specs = self.candidates()
        variants = {p for p, s in specs.items() if is_gpushare_spec(s["spec"])}
        names = {specs[p]["name"] for p in variants}
        if self.kernel_names:
            wanted = set()
            for name in self.kernel_names:
                key = name.lower()
                if key in names:
                    wanted.add(key)
                elif f"{key}{DEFAULT_SUFFIX}" in names:
                    wanted.add(f"{key}{DEFAULT_SUFFIX}")
                elif any(s["name"] == key for s in specs.values()):
                    self.fail(f"{name!r} is not a GPU-shared kernelspec: not removing it")
                else:
                    self.fail(f"no GPU-shared kernelspec named {name!r}")
            chosen = {p for p in variants if specs[p]["name"] in wanted}
        else:
            chosen = variants
        if not chosen:
            print("No GPU-shared kernelspecs installed.")
            return
        foreign = sorted(p for p in chosen if not made_here(specs[p]["spec"]))
        if foreign and not self.force:
            where = ", ".join(f"{specs[p]['name']} ({specs[p]['resource_dir']})" for p in foreign)
            if len(foreign) == len(chosen):
                self.fail(
                    f"not removing {where}: `jupyter gpushare install-kernelspec` did not make it "
                    "(pip installs python3-gpushare with the package); --force removes it anyway"
                )
            print(f"left: {where} (install-kernelspec did not make it; --force removes it)")
            chosen -= set(foreign)
        for key in sorted(chosen):
            name, path = specs[key]["name"], specs[key]["resource_dir"]
            try:
                if os.path.islink(path):
                    os.remove(path)
                else:
                    shutil.rmtree(path)
            except OSError as exc:
                self.fail(f"cannot remove {name}: {exc}")
            print(f"removed: {name} ({path})")


class GPUShareKernelspecApp(JupyterApp):
    """``jupyter gpushare``: the Jupyter side of gpushare's command line."""

    name = "jupyter-gpushare"
    version = __version__
    description = """Share one GPU among many Jupyter kernels. Manage the kernelspecs whose
    kernels run under gpushare. (The scheduler and its status are the `gpushare` command.)

    For every kernel of a server instead, without kernelspec variants, set
    c.KernelProvisionerFactory.default_provisioner_name = "gpushare-provisioner"
    in jupyter_server_config.py."""
    examples = """
    jupyter gpushare install-kernelspec --user --memory-limit 8GiB
    jupyter gpushare list-kernelspecs
    jupyter gpushare remove-kernelspec --user --name python3
    """

    subcommands = {
        "install-kernelspec": (
            InstallKernelspecApp,
            'Install "(GPU shared)" variants of kernelspecs (all, or --name NAME).',
        ),
        "list-kernelspecs": (
            ListKernelspecsApp,
            "List kernelspecs; mark those whose kernels run under gpushare.",
        ),
        "remove-kernelspec": (
            RemoveKernelspecApp,
            "Remove the GPU-shared variants that install-kernelspec made.",
        ),
    }

    def start(self) -> None:
        if self.subapp is None:
            print("No subcommand given: one of", ", ".join(self.subcommands), file=sys.stderr)
            print("Run `jupyter gpushare --help` for more.", file=sys.stderr)
            self.exit(2)
        else:
            self.subapp.start()


def main(argv: list[str] | None = None) -> None:
    """The ``jupyter-gpushare`` script."""
    GPUShareKernelspecApp.launch_instance(argv)


if __name__ == "__main__":
    main()
