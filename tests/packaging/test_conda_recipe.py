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
#: conda-build's selector names on linux-64 with Python 3.11 (selectors are Python expressions).
SELECTOR_NAMES = {"linux": True, "linux64": True, "unix": True, "osx": False, "win": False,
                  "py": 311, "py3k": True, "x86_64": True, "aarch64": False}  # fmt: skip


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
        if selector and not eval(selector.group(1), {}, dict(SELECTOR_NAMES)):
            continue  # a line for another platform or Python
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


# -- what conda-forge's linter (conda-smithy's lint rules for meta.yaml) asks ------------------


def test_recipe_passes_conda_forge_lint_rules() -> None:
    text = RECIPE.read_text()
    recipe = _render()
    # A url source carries its checksum.
    assert re.fullmatch(r"[0-9a-f]{64}", str(recipe["source"]["sha256"])), recipe["source"]
    # Built per Python (a compiled shim, not noarch): python in run has no version constraint;
    # the floor is a skip selector, the same as pyproject's requires-python.
    assert "noarch" not in recipe["build"]
    assert "python" in recipe["requirements"]["run"]
    assert not [r for r in recipe["requirements"]["run"] if re.match(r"python\s*[<>=!]", r)]
    floor = _pyproject()["project"]["requires-python"]
    major, minor = re.fullmatch(r">=(\d+)\.(\d+)", floor).groups()  # type: ignore[union-attr]
    assert f"py<{major}{minor}" in re.search(r"skip: true\s+# \[(.*)\]", text).group(1)  # type: ignore[union-attr]
    # Selectors written `  # [expr]`; requirements "name constraint", separated by a space.
    for line in text.splitlines():
        if "# [" in line:
            assert re.search(r"\S  # \[[^\]]+\]$", line), f"selector form: {line!r}"
    for section in ("build", "host", "run"):
        for req in recipe["requirements"][section]:
            assert re.fullmatch(r"[A-Za-z0-9_.-]+( [^ ].*)?", req), f"requirement form: {req!r}"
    # A C compiler comes with the C standard library's pin; the recipe has tests and owners.
    assert {"compiler_c", "stdlib_c"} <= set(recipe["requirements"]["build"])
    assert recipe["build"]["number"] == 0
    assert recipe["test"]["commands"] and recipe["test"]["imports"]
    assert recipe["extra"]["recipe-maintainers"]
    for key in ("home", "summary", "license", "license_file", "dev_url", "doc_url"):
        assert recipe["about"][key], key


def test_set_sha256_writes_a_release_sdists_checksum(tmp_path: Path) -> None:
    import hashlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("set_sha256", RECIPE.with_name("set_sha256.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sdist = tmp_path / "jupyter_gpushare-0.1.0.tar.gz"
    sdist.write_bytes(b"an sdist")
    recipe = tmp_path / "meta.yaml"
    recipe.write_text(RECIPE.read_text())
    value = module.set_sha256(sdist, recipe)
    assert value == hashlib.sha256(b"an sdist").hexdigest()
    assert f'{{% set sha256 = "{value}" %}}' in recipe.read_text()
    assert recipe.read_text().replace(value, "") == RECIPE.read_text().replace(
        re.search(r'set sha256 = "([0-9a-f]+)"', RECIPE.read_text()).group(1),
        "",  # type: ignore[union-attr]
    )
