"""Build the native parts with the system C compiler; no CUDA toolkit is needed.

One place for the compiler command line, so the wheel (hatch_build.py), the tests (which also build
the stand-in driver and the test programs) and a developer's shell all compile the same way:

    python native/build.py shim OUTPUT.so
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

NATIVE = Path(__file__).resolve().parent
SRC = NATIVE / "src"
INCLUDE = NATIVE / "include"

# C11, warnings as errors: a signature slip in a shim corrupts silently, so let the compiler
# refuse anything suspicious.
CFLAGS = [
    "-std=c11",
    "-O2",
    "-g",
    "-fPIC",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
    "-D_GNU_SOURCE",
    "-pthread",
]


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def _run(cmd: list[str]) -> None:
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError as e:
        raise SystemExit(
            f"gpushare: no C compiler found ({cmd[0]}); install gcc or set CC to build the shim"
        ) from e


def _compile(
    sources: list[Path], output: Path, kind: list[str], extra: list[str] | None = None
) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    _run(
        [
            *compiler(),
            *CFLAGS,
            *kind,
            f"-I{INCLUDE}",
            f"-I{SRC}",
            "-o",
            str(output),
            *map(str, sources),
            *(extra or []),
            "-ldl",
            "-lpthread",
        ]
    )
    return output


def build_shim(output: Path) -> Path:
    """Compile libgpushare.so from native/src/*.c into ``output``."""
    # -fvisibility=hidden: only what the shim means to interpose or offer is exported.
    # No libm: the shim must dlopen(RTLD_NOW) into any process (bench/launch_ab.c does), so it
    # calls nothing from it (config.c rounds the weight by hand).
    # --no-undefined: a handler named in hooks.def but defined nowhere must fail the build, not
    # the first program that calls it.
    return _compile(
        sorted(SRC.glob("*.c")),
        output,
        ["-fvisibility=hidden", "-shared", "-Wl,--no-undefined"],
    )


def build_shared(sources: list[Path], output: Path, extra: list[str] | None = None) -> Path:
    """Compile a shared library (the tests' stand-in libcuda.so.1)."""
    return _compile(sources, output, ["-shared"], extra)


def build_program(sources: list[Path], output: Path, extra: list[str] | None = None) -> Path:
    """Compile a test or benchmark program."""
    return _compile(sources, output, [], extra)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "shim":
        raise SystemExit("usage: python native/build.py shim OUTPUT.so")
    print(build_shim(Path(sys.argv[2])))
