"""The command line checked in the user's words, before and after traitlets reads it.

traitlets' parser answers ``--pool -1GiB`` with a usage block and "expected one argument" (the
value looks like an option), ``--bogus`` the same way, takes stray words silently, and names a bad
value by its trait (``metrics_port``) rather than by the flag the user typed (``--metrics-port``).
:func:`check_argv` reads the arguments first and :func:`in_user_words` rewrites a configuration
error, so that every mistake is one line naming what the user wrote.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["UsageError", "check_argv", "in_user_words"]

#: Options every traitlets application understands without an alias or a flag of ours.
_BUILT_IN = frozenset({"help", "help-all", "version"})
_NEGATIVE_NUMBER = re.compile(r"^-[0-9.]")
_SIZE_UNIT = re.compile(r"^(?:[kmgt]i?b?|b)$", re.IGNORECASE)


class UsageError(ValueError):
    """A command line that cannot mean what it says: the message is the one line to print."""


def _names(table: Mapping[Any, Any]) -> set[str]:
    """Option names of an aliases or flags table (traitlets allows a tuple of spellings)."""
    out: set[str] = set()
    for key in table:
        out.update(key if isinstance(key, tuple) else (key,))
    return out


def check_argv(
    argv: Iterable[str],
    aliases: Mapping[Any, Any],
    flags: Mapping[Any, Any],
    positional: int,
    command: str,
) -> list[str]:
    """The arguments as traitlets should read them, or UsageError saying what is wrong.

    ``positional``: how many words that are not options the command takes. A negative number after
    an option that takes a value is that option's value (``--pool -1GiB`` becomes
    ``--pool=-1GiB``, so the value's own check says what is wrong with it); an option that is
    neither ours nor traitlets' ``--Class.trait`` form is unknown; a word past ``positional`` is
    stray (a unit after a size is the likeliest: ``--memory-limit 24 GB``)."""
    args = list(argv)
    valued = _names(aliases)
    switches = _names(flags) | _BUILT_IN
    out: list[str] = []
    words = 0
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out.extend(args[i:])
            break
        if arg.startswith("-") and arg != "-" and not _NEGATIVE_NUMBER.match(arg):
            name, has_value, _ = arg.lstrip("-").partition("=")
            takes_value = name in valued or "." in name  # --Class.trait takes a value too
            if not takes_value and name not in switches and name != "h" and name != "V":
                raise UsageError(
                    f"{command}: unknown option {arg.partition('=')[0]} "
                    f"(`{command} --help` lists the options)"
                )
            if takes_value and not has_value and (i + 1 == len(args) or args[i + 1] == "--"):
                raise UsageError(f"{command}: {arg} needs a value")
            if takes_value and not has_value:
                value = args[i + 1]
                if _NEGATIVE_NUMBER.match(value):
                    out.append(f"{arg}={value}")
                else:
                    out.extend([arg, value])
                i += 2
                continue
            out.append(arg)
            i += 1
            continue
        words += 1
        if words > positional:
            raise UsageError(_stray(command, args, i))
        out.append(arg)
        i += 1
    return out


def _stray(command: str, args: list[str], i: int) -> str:
    word = args[i]
    where = " before `--`" if "--" in args[i:] else ""
    hint = ""
    if i >= 2 and args[i - 2].startswith("--") and _SIZE_UNIT.match(word):
        hint = f": did you mean {args[i - 2]} {args[i - 1]}{word}?"
    elif where:
        hint = ": options go before `--`, the command after it"
    return f"{command}: unexpected argument {word!r}{where}{hint}"


_TRAIT_PHRASE = re.compile(r"The (?:value of the )?'(\w+)' trait of an? (\w+) instance:?\s*")


def in_user_words(text: str, aliases: Mapping[Any, Any], command_line: Any) -> str:
    """A configuration error that names a trait (``pool_size: ...``, or traitlets' "The 'x' trait
    of a C instance ...") rewritten to name what the user set: the flag as typed when the command
    line set it (``--pool``), else the config file's ``c.Class.trait``."""
    flag_of = {}
    for key, target in aliases.items():
        if isinstance(target, str):
            for name in key if isinstance(key, tuple) else (key,):
                flag_of.setdefault(target, f"--{name}" if len(name) > 1 else f"-{name}")

    def where(trait: str, cls: str | None) -> str:
        targets = [t for t in flag_of if t.rsplit(".", 1)[-1] == trait]
        if cls is None and targets:
            cls = targets[0].split(".", 1)[0]
        if cls is None:
            return trait
        target = f"{cls}.{trait}"
        section = command_line.get(cls, {}) if command_line is not None else {}
        if trait in section:
            return flag_of.get(target, f"--{target}")
        return f"c.{target}"

    match = _TRAIT_PHRASE.search(text)
    if match:
        return f"{where(match.group(1), match.group(2))}: {text[match.end() :]}"
    head, sep, rest = text.partition(": ")
    if sep and re.fullmatch(r"(?:\w+\.)?\w+", head):
        cls, _, trait = head.rpartition(".")
        return f"{where(trait, cls or None)}: {rest}"
    return text
