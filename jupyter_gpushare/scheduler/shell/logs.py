"""JSON log lines for the node scheduler (``gpushare scheduler --log-format json``).

One event per line, for journald/Loki/Elasticsearch: ``ts`` (UTC, ISO 8601 with milliseconds),
``level``, ``logger``, ``message`` (the text line as it would be printed), ``event`` (the
message's first word when ``key=value`` fields follow it, e.g. ``grant``, ``revoke``, ``join``),
and each field as its own JSON key. The JSON itself is python-json-logger's.

The fields come from the log call, not from the printed text: the scheduler logs
``log.info("grant client=%s restore=%d waited_ms=%s", client, 1, ms)``, and each ``key=%x`` of
the format string takes the argument that fills it, as given (an int stays an int; a text of a
number becomes the number). So a value can never add or replace a field, whatever it contains
(a label ``"x reason=forged"`` is one ``label`` value). ``key=value`` written literally in the
format string is a field too, and so is an argument placed bare (``%s``) that the scheduler
composes as fields itself (``bytes=1048576 (1.00 MiB)``). A message's fields never replace the
base keys (they get a ``field_`` prefix instead).

    >>> import logging
    >>> rec = logging.LogRecord("gpushare", logging.INFO, "", 0,
    ...                         "grant client=%s restore=%d waited_ms=%s", ("k1", 1, "2.5"), None)
    >>> doc = json.loads(JsonFormatter().format(rec))
    >>> doc["event"], doc["client"], doc["restore"], doc["waited_ms"]
    ('grant', 'k1', 1, 2.5)
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

from ...protocol import printable

__all__ = ["JsonFormatter", "PrintableFilter", "escape_log", "event_word", "template_fields"]

#: A printf conversion in a format string (the scheduler's own text, never a value).
_CONVERSION = re.compile(r"%(?:\((\w+)\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_BASE = ("ts", "level", "logger", "message", "event", "exception")


def _typed(value: Any) -> Any:
    """An argument as a field: numbers and bools as they are, a text of a number as the number,
    anything else as its text."""
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    text = str(value)
    if _NUMBER.fullmatch(text):
        return float(text) if any(ch in text for ch in ".eE") else int(text)
    return text


def _is_key(word: str) -> bool:
    return word[:1].isascii() and word[:1].islower() and word.replace("_", "a").isalnum()


def _literal_fields(text: str) -> Iterator[tuple[str, str]]:
    """``key=value`` words written in the format string itself (``step=evict``)."""
    for word in text.split():
        key, eq, value = word.partition("=")
        if eq and value and _is_key(key):
            yield key, _typed(value.rstrip(",;:)"))


def template_fields(msg: str, args: Any) -> dict[str, Any]:
    """The fields of a log call ``(msg, args)`` (see the module docstring)."""
    if not isinstance(args, tuple):
        args = (args,) if args else ()
    fields: dict[str, Any] = {}
    pos, i = 0, 0
    for conv in _CONVERSION.finditer(msg):
        literal = msg[pos : conv.start()]
        pos = conv.end()
        if conv.group(0) == "%%":
            continue
        if i >= len(args):
            break
        arg = args[i]
        i += 1
        fields.update(_literal_fields(literal.rsplit(" ", 1)[0]))
        before = literal.rsplit(" ", 1)[-1]
        if before.endswith("=") and _is_key(before[:-1]):
            fields[before[:-1]] = _typed(arg)
        elif before == "" and isinstance(arg, str):
            # A bare argument: a fragment the scheduler composes as fields (bytes=N (...)).
            fields.update(_literal_fields(arg.split(" (")[0]))
    fields.update(_literal_fields(msg[pos:]))
    return fields


def event_word(msg: str, message: str) -> str | None:
    """The event: the message's first word when the format string's second word is a field
    (``grant client=%s``; also ``%s client=%s``, where the scheduler passes the word)."""
    words = msg.split(" ", 2)
    first = message.split(" ", 1)[0]
    if len(words) > 1 and "=" in words[1] and _is_key(first):
        return first
    return None


class JsonFormatter(_LibraryJsonFormatter):
    """Formats each record as one JSON object (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(json_ensure_ascii=False, json_default=str)

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        log_data["ts"] = f"{stamp}.{int(record.msecs):03d}Z"
        log_data["level"] = record.levelname.lower()
        log_data["logger"] = record.name
        message = log_data["message"] = record.getMessage()
        event = event_word(str(record.msg), message)
        if event is not None:
            log_data["event"] = event
        for key, value in template_fields(str(record.msg), record.args).items():
            log_data[f"field_{key}" if key in _BASE else key] = value
        if record.exc_info:
            log_data["exception"] = self.formatException(record.exc_info)

    def jsonify_log_record(self, log_data: dict[str, Any]) -> str:
        return json.dumps(log_data, ensure_ascii=False, default=str)


class PrintableFilter(logging.Filter):
    """Escapes every character a terminal or a log reader would act on in a record's message
    (:func:`..protocol.printable`): what peers send (a device uuid, a shim's version, a place
    id) must not forge a log line or move a cursor, in the text log as in the JSON one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.isprintable():
            record.msg, record.args = printable(message), ()
        return True


def escape_log(log: Any) -> None:
    """Install :class:`PrintableFilter` on ``log`` (a Logger or a LoggerAdapter), once."""
    logger = getattr(log, "logger", log)
    if isinstance(logger, logging.Logger) and not any(
        isinstance(f, PrintableFilter) for f in logger.filters
    ):
        logger.addFilter(PrintableFilter())
