"""The shim's C files stay small and layered: no file over the size limit, no call cycle, no
include cycle, and nothing that reaches up a room.

The sources live in rooms (native/src/hooks, client, memory, base: native/build.py's ROOMS, top
to bottom): a file calls and includes only its own room and the rooms below it. The one way up is
a port: a header of the lower room that declares what it needs from the room above, which
implements it (memory/client.h: the memory engine's three questions to the client). Within the
rooms, native/README.md's table orders the files: a file calls only the files below it.

The call graph is read from the preprocessed sources (so hooks.def and the macros count as what
they expand to): file A depends on file B when code of A names a function defined, non-static, in
B. Static inline functions of the headers are followed into the file that uses them. A cycle
between files is what issue 12 found (client.c <-> gate.c <-> memory.c): it must not come back.
The include graph is read from the sources' own `#include "..."` lines.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import _load_build_module

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "native" / "src"
INCLUDE = ROOT / "native" / "include"

ROOMS: tuple[str, ...] = _load_build_module().ROOMS
# Headers through which a room asks the room above it for something, and that room: the only
# functions a file may call up a room are those its own room's port declares.
PORTS = {"memory/client.h": "client"}

MAX_LINES = 550
# Files over the limit that another change is replacing, with why. The test fails once such a
# file is back under the limit, so that the exemption is removed with it.
OVER_LIMIT_FOR_NOW: dict[str, str] = {}

_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "do", "else", "case", "goto"}
_TOKEN = re.compile(
    r"""(?P<str>"(?:\\.|[^"\\])*")|(?P<chr>'(?:\\.|[^'\\])*')|(?P<id>[A-Za-z_]\w*)|(?P<p>[{}();,])"""
)


def _preprocess(path: Path) -> str:
    cc = shlex.split(os.environ.get("CC", "cc"))
    out = subprocess.run(
        [*cc, "-E", "-std=c11", "-D_GNU_SOURCE", f"-I{INCLUDE}", f"-I{SRC}", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def _own_text(pre: str, path: Path) -> tuple[str, str]:
    """Split preprocessed text into what came from the file itself (or hooks.def, which only
    the .c files include) and what came from the shim's own headers."""
    own: list[str] = []
    headers: list[str] = []
    stack: list[Path] = []
    for line in pre.splitlines():
        m = re.match(r'# \d+ "([^"]+)"((?: \d)*)', line)
        if m:
            name, flags = Path(m.group(1)), m.group(2).split()
            if "1" in flags:
                stack.append(name)
            elif "2" in flags:
                stack.pop()
                stack[-1:] = [name]
            else:
                stack[-1:] = [name]
            continue
        if not stack:
            continue
        here = stack[-1].resolve()
        parent = stack[-2].resolve() if len(stack) > 1 else None
        if here == path.resolve() or (here.name == "hooks.def" and parent == path.resolve()):
            own.append(line)
        elif SRC.resolve() in here.parents or here.parent == INCLUDE.resolve():
            headers.append(line)
    return "\n".join(own), "\n".join(headers)


def _tokens(text: str) -> Iterator[str]:
    for m in _TOKEN.finditer(text):
        if m.group("id") or m.group("p"):
            yield m.group(0)


def _functions(text: str) -> list[tuple[str, bool, bool, set[str]]]:
    """(name, is_static, is_inline, identifiers used in its body) for every function defined
    at file scope, plus one pseudo-entry "" for identifiers used outside any body (tables)."""
    toks = list(_tokens(text))
    out: list[tuple[str, bool, bool, set[str]]] = []
    outside: set[str] = set()
    depth = 0
    decl: list[str] = []  # tokens of the current file-scope declaration
    body: set[str] | None = None
    i = 0
    while i < len(toks):
        t = toks[i]
        if depth == 0:
            if t == "{":
                # A function definition: IDENT ( ... ) {
                name = None
                if decl and decl[-1] == ")":
                    level = 0
                    for j in range(len(decl) - 1, -1, -1):
                        if decl[j] == ")":
                            level += 1
                        elif decl[j] == "(":
                            level -= 1
                            if level == 0:
                                if j > 0 and re.match(r"[A-Za-z_]\w*$", decl[j - 1]):
                                    name = decl[j - 1]
                                break
                if name and "=" not in decl:
                    body = set()
                    out.append((name, "static" in decl, "inline" in decl, body))
                else:
                    body = None
                    outside.update(x for x in decl if re.match(r"[A-Za-z_]", x))
                depth = 1
                decl = []
            elif t == ";":
                outside.update(x for x in decl if re.match(r"[A-Za-z_]", x))
                decl = []
            else:
                decl.append(t)
        else:
            if t == "{":
                depth += 1
            elif t == "}":
                depth -= 1
                if depth == 0:
                    body = None
            elif re.match(r"[A-Za-z_]", t) and t not in _KEYWORDS:
                (body if body is not None else outside).add(t)
        i += 1
    out.append(("", False, False, outside))
    return out


def _key(path: Path) -> str:
    """A file's name in the graph and in native/README.md: its room and name (memory/move.c)."""
    return path.relative_to(SRC).as_posix()


@functools.cache
def _calls() -> tuple[dict[str, dict[str, set[str]]], dict[str, str]]:
    """file -> file it calls -> the names it calls there; and where each function is defined."""
    files = sorted(SRC.glob("*/*.c"))
    defined: dict[str, str] = {}  # non-static function -> file
    uses: dict[str, set[str]] = {}
    inline_uses: dict[str, set[str]] = {}
    for path in files:
        own, headers = _own_text(_preprocess(path), path)
        names: set[str] = set()
        for name, static, _inline, body in _functions(own):
            if name and not static:
                assert defined.get(name, _key(path)) == _key(path), f"{name} defined twice"
                defined[name] = _key(path)
            names |= body
        uses[_key(path)] = names
        for name, _static, inline, body in _functions(headers):
            if inline:
                inline_uses[name] = body
    # Follow the headers' static inline functions into the files that use them.
    for name_set in uses.values():
        todo = [n for n in name_set if n in inline_uses]
        seen: set[str] = set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for m in inline_uses[n]:
                name_set.add(m)
                if m in inline_uses:
                    todo.append(m)
    calls: dict[str, dict[str, set[str]]] = {}
    for f, names in uses.items():
        calls[f] = {}
        for n in names:
            if n in defined and defined[n] != f:
                calls[f].setdefault(defined[n], set()).add(n)
    return calls, defined


def _graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    calls, defined = _calls()
    return {f: set(callees) for f, callees in calls.items()}, defined


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_file_is_too_long() -> None:
    too_long = {}
    for path in sorted(SRC.glob("*/*")):
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and _key(path) not in OVER_LIMIT_FOR_NOW:
            too_long[_key(path)] = n
        if _key(path) in OVER_LIMIT_FOR_NOW:
            assert n > MAX_LINES, f"{_key(path)} is {n} lines now: drop its exemption"
    assert not too_long, f"files over {MAX_LINES} lines: {too_long}"


def test_the_call_graph_between_files_has_no_cycle() -> None:
    graph, _ = _graph()
    cycle = _cycle(graph)
    assert cycle is None, "call cycle between files: " + " -> ".join(cycle or [])


def test_the_checker_sees_calls_through_macros_and_inlines() -> None:
    """The graph must see what the exports call (hooks.def) and what the inline fast path calls,
    or the cycle test above could pass by not seeing edges."""
    graph, defined = _graph()
    assert defined["gs_gate_slow"] == "client/wait.c"
    # GS_GATED -> gs_gate_enter (inline) -> gs_gate_slow
    assert "client/wait.c" in graph["hooks/hook.c"]
    assert "memory/memory.c" in graph["hooks/hook.c"]  # GS_CUSTOM -> gs_mem_alloc
    # GS_REAL -> gs_real (inline) -> gs_real_slow
    assert "base/loader.c" in graph["memory/memory.c"]
    assert "client/session.c" in graph["memory/table.c"]  # gs_client_wake


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a.c": {"b.c"}, "b.c": {"c.c"}, "c.c": {"a.c"}}) == [
        "a.c",
        "b.c",
        "c.c",
        "a.c",
    ]
    assert _cycle({"a.c": {"b.c"}, "b.c": set()}) is None


def _documented_order() -> list[str]:
    readme = (ROOT / "native" / "README.md").read_text()
    return re.findall(r"^\| `(\w+/\w+\.c)`", readme, flags=re.M)


def test_every_call_goes_down_the_documented_layering() -> None:
    """native/README.md lists the files top to bottom, room by room; a file may call only files
    below it (or what its room's port declares)."""
    calls, _ = _calls()
    order = _documented_order()
    assert sorted(order) == sorted(calls), "native/README.md must list every file of native/src"
    rooms = [_room(f) for f in order]
    assert rooms == sorted(rooms), f"native/README.md's table must list the rooms {ROOMS} in order"
    rank = {f: i for i, f in enumerate(order)}
    upward = _calls_up(calls, rank, _port_functions())
    assert not upward, f"calls up the layering of native/README.md: {upward}"


# ---- the rooms ----


def _room(key: str) -> int:
    """A room's rank, 0 at the top (hooks)."""
    return ROOMS.index(key.split("/", 1)[0])


def _port_functions() -> dict[str, set[str]]:
    """room -> the functions its port headers declare (what it may call in the room above)."""
    out: dict[str, set[str]] = {}
    for header in PORTS:
        text = re.sub(r"/\*.*?\*/", "", (SRC / header).read_text(), flags=re.S)
        out.setdefault(header.split("/", 1)[0], set()).update(re.findall(r"(gs_\w+)\s*\(", text))
    return out


def _calls_up(
    calls: dict[str, dict[str, set[str]]], rank: dict[str, int], allowed: dict[str, set[str]]
) -> list[str]:
    """The calls from a file to a file ranked above it (rank: lower is higher up), less those to
    functions that the caller's room's port declares (allowed: room -> names)."""
    up = []
    for a, callees in calls.items():
        for b, names in callees.items():
            if rank[b] < rank[a]:
                rest = names - allowed.get(a.split("/", 1)[0], set())
                if rest:
                    up.append(f"{a} -> {b} ({', '.join(sorted(rest))})")
    return sorted(up)


def _includes() -> dict[str, set[str]]:
    """file -> the shim's files it includes (quoted includes, resolved as the compiler does:
    beside the file, then native/src, then native/include)."""
    out: dict[str, set[str]] = {}
    for path in sorted(SRC.glob("*/*")):
        found: set[str] = set()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), flags=re.M):
            for base in (path.parent, SRC, INCLUDE):
                target = (base / name).resolve()
                if target.is_file():
                    break
            else:
                raise AssertionError(f'{_key(path)}: #include "{name}" found nowhere')
            if SRC.resolve() in target.parents:
                found.add(target.relative_to(SRC.resolve()).as_posix())
        out[_key(path)] = found
    return out


def test_every_source_lies_in_a_room() -> None:
    """build.py compiles the rooms' files only: a file beside them, or in a folder that is no
    room, would be left out of the shim (or be a room nobody ordered)."""
    stray = sorted(
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*")
        if p.is_file() and (len(p.relative_to(SRC).parts) != 2 or p.parent.name not in ROOMS)
    )
    assert not stray, f"files of native/src outside the rooms {ROOMS}: {stray}"
    assert {p.name for p in SRC.iterdir()} == set(ROOMS)


def test_no_call_goes_up_a_room() -> None:
    calls, _ = _calls()
    rank = {f: _room(f) for f in calls}
    up = _calls_up(calls, rank, _port_functions())
    assert not up, f"calls up a room (native/README.md): {up}"


def test_each_port_is_implemented_in_the_room_above() -> None:
    """A port declares what the room above implements; a function of its own room declared
    there would open a way up for nothing."""
    _, defined = _calls()
    for header, implementer in PORTS.items():
        names = _port_functions()[header.split("/", 1)[0]]
        assert names, f"{header} declares nothing"
        assert {defined[n].split("/", 1)[0] for n in names} == {implementer}, header
        assert ROOMS.index(implementer) < _room(header)


def test_no_include_goes_up_a_room() -> None:
    """A file includes headers of its own room and the rooms below, never one above (a port is
    a header of the lower room; the room above includes it to implement it)."""
    up = sorted(f"{a} -> {b}" for a, bs in _includes().items() for b in bs if _room(b) < _room(a))
    assert not up, f"includes up a room: {up}"


def test_the_includes_have_no_cycle() -> None:
    cycle = _cycle(_includes())
    assert cycle is None, "include cycle: " + " -> ".join(cycle or [])


def test_only_the_top_room_exports() -> None:
    """The library's exports (GS_EXPORT: the hooks, dlsym, the status API) are the doors: they
    live in hooks/, the room nothing calls."""
    exporting = sorted(
        _key(p)
        for p in SRC.glob("*/*.c")
        if re.search(r"\bGS_EXPORT\b", re.sub(r"/\*.*?\*/", "", p.read_text(), flags=re.S))
    )
    assert exporting and {f.split("/", 1)[0] for f in exporting} == {ROOMS[0]}, exporting


def test_the_room_check_sees_a_call_up() -> None:
    calls = {
        "client/a.c": {"memory/b.c": {"gs_mem_x"}},
        "memory/b.c": {"client/a.c": {"gs_client_wake", "gs_session_get"}, "base/c.c": {"y"}},
        "base/c.c": {},
    }
    rank = {f: _room(f) for f in calls}
    assert _calls_up(calls, rank, {}) == [
        "memory/b.c -> client/a.c (gs_client_wake, gs_session_get)"
    ]
    # The port lets through what it declares, and only that.
    assert _calls_up(calls, rank, {"memory": {"gs_client_wake"}}) == [
        "memory/b.c -> client/a.c (gs_session_get)"
    ]
