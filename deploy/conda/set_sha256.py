"""Write a release sdist's sha256 into deploy/conda/meta.yaml (the recipe's `source: sha256`,
which conda-build checks the download against). Run at each release, on the sdist that is
uploaded:

    python -m build --sdist && python deploy/conda/set_sha256.py dist/jupyter_gpushare-X.Y.Z.tar.gz
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

RECIPE = Path(__file__).with_name("meta.yaml")
_SET = re.compile(r'({%\s*set\s+sha256\s*=\s*")[0-9a-f]*("\s*%})')


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def set_sha256(sdist: Path, recipe: Path = RECIPE) -> str:
    """Put ``sdist``'s sha256 into ``recipe``; return it."""
    value = sha256_of(sdist)
    text, n = _SET.subn(lambda m: m.group(1) + value + m.group(2), recipe.read_text())
    if n != 1:
        raise SystemExit(f'{recipe}: no `{{% set sha256 = "..." %}}` line')
    recipe.write_text(text)
    return value


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(set_sha256(Path(sys.argv[1])))
