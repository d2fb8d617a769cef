"""deploy/conda/meta.yaml against pyproject.toml: the same version, license, entry points and
run requirements (a dependency added to one and not the other breaks the conda package only)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from jupyter_gpushare import _version

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy" / "conda" / "meta.yaml"


def _render() -> dict:
    """The recipe with its Jinja variables and selectors resolved the simple way conda-build
    would on linux-64 with Python 3.11 (enough for the fields compared here)."""
    text = RECIPE.read_text()
    variables = dict(re.findall(r'{%\s*set\s+(\w+)\s*=\s*"([^"]*)"\s*%}', text))
    text = re.sub(r"{%.*?%}", "", text)
    text = re.sub(r"{{\s*name\|lower\s*}}", variables["name"].lower(), text)
    text = re.sub(r"{{\s*(\w+)\s*}}", lambda m: variables.get(m.group(1), m.group(1)), text)
    text = re.sub(r"{{\s*(compiler|stdlib)\('(\w+)'\)\s*}}", r"\1_\2", text)
    lines = []
    for line in text.splitlines():
        selector = re.search(r"#\s*\[(.*)\]\s*$", line)
        if selector and selector.group(1).strip() in ("not linux", "py<311"):
            continue  # false on linux-64, py311
        lines.append(line)
    return yaml.safe_load("\n".join(lines))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(req: str) -> str:
    return re.split(r"[ <>=!;\[]", req.strip(), maxsplit=1)[0].lower().replace("-", "_")


def test_recipe_matches_pyproject() -> None:
    recipe = _render()
    project = _pyproject()["project"]
    assert recipe["package"]["name"] == project["name"]
    assert recipe["package"]["version"] == _version.__version__
    assert recipe["about"]["license"] == project["license"]
    assert (ROOT / recipe["about"]["license_file"]).exists()
    scripts = {f"{k} = {v}" for k, v in project["scripts"].items()}
    assert set(recipe["build"]["entry_points"]) == scripts
    assert recipe["source"]["url"].endswith(f"jupyter_gpushare-{_version.__version__}.tar.gz")


def test_recipe_run_requirements_are_the_dependencies() -> None:
    recipe = _render()
    deps = {_name(d) for d in _pyproject()["project"]["dependencies"] if "python_version" not in d}
    run = {_name(r) for r in recipe["requirements"]["run"]} - {"python"}
    assert run == deps
    host = {_name(r) for r in recipe["requirements"]["host"]}
    # ziglang only makes the PyPI wheel's shim portable (native/build.py falls back to the
    # system compiler); conda-forge's compiler('c') and stdlib('c') already target an old glibc.
    backend = {_name(r) for r in _pyproject()["build-system"]["requires"]} - {"ziglang"}
    assert backend <= host, "the recipe builds with --no-build-isolation: host needs the backend"
