"""Build the native parts with the system C compiler; no CUDA toolkit is needed.

One place for the compiler command line, so the wheel (hatch_build.py), the tests (which also build
the stand-in driver and the test programs) and a developer's shell all compile the same way:

    python native/build.py shim OUTPUT.so
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

NATIVE = Path(__file__).resolve().parent
SRC = NATIVE / "src"
INCLUDE = NATIVE / "include"
#: The shim's rooms (native/README.md), top to bottom: a file calls and includes only its own
#: room and the rooms below it (tests/native/test_layering.py). A file names a header of another
#: room by its path from SRC (``#include "base/shim.h"``), one of its own room by its name.
ROOMS = ("hooks", "client", "memory", "base")


def shim_sources() -> list[Path]:
    """Every C file of the shim, room by room."""
    return [path for room in ROOMS for path in sorted((SRC / room).glob("*.c"))]


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


#: The oldest glibc a portable shim (the wheel's) is linked for: manylinux_2_28 (RHEL 8, Ubuntu
#: 20.04 and later).
PORTABLE_GLIBC = (2, 28)


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def portable_compiler() -> list[str] | None:
    """Zig's C compiler (the ``ziglang`` package) targeting PORTABLE_GLIBC, or None when it is
    not installed or the machine is not one it targets. $CC, when set, wins."""
    import importlib.util
    import platform

    arch = {"x86_64": "x86_64", "aarch64": "aarch64"}.get(platform.machine())
    if os.environ.get("CC") or arch is None or importlib.util.find_spec("ziglang") is None:
        return None
    major, minor = PORTABLE_GLIBC
    return [sys.executable, "-m", "ziglang", "cc", "-target", f"{arch}-linux-gnu.{major}.{minor}"]


def _run(cmd: list[str]) -> None:
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError as e:
        raise SystemExit(
            f"gpushare: no C compiler found ({cmd[0]}); install gcc or set CC to build the shim"
        ) from e


def _compile(
    sources: list[Path],
    output: Path,
    kind: list[str],
    extra: list[str] | None = None,
    cc: list[str] | None = None,
) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    _run(
        [
            *(cc or compiler()),
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


def build_shim(output: Path, portable: bool = False) -> Path:
    """Compile libgpushare.so from native/src/<room>/*.c into ``output``; ``portable``: for the
    oldest glibc that portable_compiler() targets, when it is there (the wheel)."""
    # -fvisibility=hidden: only what the shim means to interpose or offer is exported.
    # No libm: the shim must dlopen(RTLD_NOW) into any process (bench/launch_ab.c does), so it
    # calls nothing from it (config.c rounds the weight by hand).
    # --no-undefined: a handler named in hooks.def but defined nowhere must fail the build, not
    # the first program that calls it.
    kind = ["-fvisibility=hidden", "-shared", "-Wl,--no-undefined"]
    zig = portable_compiler() if portable else None
    if zig:
        try:
            return _compile(shim_sources(), output, kind, cc=zig)
        except subprocess.CalledProcessError:
            print(
                "gpushare: zig cc failed; building the shim with the system compiler (the wheel "
                "then needs this machine's glibc)",
                file=sys.stderr,
            )
    return _compile(shim_sources(), output, kind)


def glibc_needed(library: Path) -> tuple[int, int]:
    """The newest glibc symbol version that ``library`` (a 64-bit little-endian ELF) needs: the
    GLIBC_2.N names of its version references (.gnu.version_r), at least 2.17, the oldest
    manylinux."""
    data = library.read_bytes()
    shoff, shentsize, shnum = (
        int.from_bytes(data[0x28:0x30], "little"),
        int.from_bytes(data[0x3A:0x3C], "little"),
        int.from_bytes(data[0x3C:0x3E], "little"),
    )

    def section(i: int) -> tuple[int, int, int, int]:  # type, offset, size, link
        h = data[shoff + i * shentsize : shoff + (i + 1) * shentsize]
        return (
            int.from_bytes(h[4:8], "little"),
            int.from_bytes(h[24:32], "little"),
            int.from_bytes(h[32:40], "little"),
            int.from_bytes(h[40:44], "little"),
        )

    def u(off: int, n: int) -> int:
        return int.from_bytes(data[off : off + n], "little")

    versions = [(2, 17)]
    for i in range(shnum):
        kind, off, _size, link = section(i)
        if kind != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        strtab = section(link)[1]
        need = off
        while True:
            aux = need + u(need + 8, 4)
            for _ in range(u(need + 2, 2)):
                name = data[strtab + u(aux + 8, 4) :].split(b"\0", 1)[0]
                m = re.fullmatch(rb"GLIBC_2\.(\d+)(?:\.\d+)?", name)
                if m:
                    versions.append((2, int(m.group(1))))
                aux += u(aux + 12, 4)
            if not u(need + 12, 4):
                break
            need += u(need + 12, 4)
    return max(versions)


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
