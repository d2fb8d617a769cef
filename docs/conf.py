"""The documentation site: Sphinx with MyST (the Markdown pages as they are) and the PyData theme,
as Jupyter's own projects build theirs. Build: ``pip install -e '.[docs]'`` then
``sphinx-build -n -W --keep-going docs docs/_build/html`` (tests/packaging/test_docs_site.py)."""

from __future__ import annotations

project = "jupyter-gpushare"
author = "jupyter-gpushare developers"
copyright = "jupyter-gpushare developers"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Result files, run logs and the REST API's schema are linked to, not pages.
exclude_patterns = ["_build", "perf-runs", "gpu-runs", "operators/README.md"]
myst_heading_anchors = 4  # the pages link to each other's sections by their GitHub anchors
myst_enable_extensions = ["colon_fence"]
# Links from the pages to the repository's files outside docs/ (deploy/, bench/, the README) go to
# the repository on GitHub.
REPOSITORY = "https://github.com/jupyter-gpushare/jupyter-gpushare/blob/main/"


html_theme = "pydata_sphinx_theme"
html_title = "jupyter-gpushare"
html_theme_options = {
    "github_url": "https://github.com/jupyter-gpushare/jupyter-gpushare",
    "navigation_with_keys": False,
}

# Links from the pages to the repository's files and folders outside the pages (deploy/, bench/,
# the README, result files) become links to the repository on GitHub, where they can be read.
import posixpath  # noqa: E402
from pathlib import Path  # noqa: E402

from docutils import nodes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "https://github.com/jupyter-gpushare/jupyter-gpushare/"


def _repository_file(refdoc: str, target: str) -> str | None:
    """The GitHub address of the repository file or folder that ``target`` (a link in the page
    ``refdoc``) names, when it is not one of the pages."""
    if "://" in target:
        return None
    base = ROOT / "docs" / posixpath.dirname(refdoc)
    path = Path(posixpath.normpath(target if target.startswith("/") else base / target))
    for candidate in (path, path.with_suffix(".md")):
        inside = ROOT in candidate.parents
        page = (ROOT / "docs") in candidate.parents and candidate.suffix == ".md"
        if inside and candidate.exists() and not page:
            kind = "tree" if candidate.is_dir() else "blob"
            return f"{REPOSITORY}{kind}/main/{candidate.relative_to(ROOT).as_posix()}"
    return None


def _link_repository_files(app, doctree):
    from sphinx import addnodes

    for node in list(doctree.findall(addnodes.pending_xref)):
        if node.get("reftype") != "myst":
            continue
        uri = _repository_file(node.get("refdoc", app.env.docname), node.get("reftarget", ""))
        if uri is not None:
            node.replace_self(nodes.reference("", "", *node.children, refuri=uri, internal=False))


def setup(app):
    app.connect("doctree-read", _link_repository_files)
