"""JSON log lines for the node scheduler (``gpushare scheduler --log-format json``).

One event per line, for journald/Loki/Elasticsearch: ``ts`` (UTC, ISO 8601 with milliseconds),
``level``, ``logger``, ``message`` (the text line as it would be printed), ``event`` (the
message's first word when ``key=value`` fields follow it, e.g. ``grant``, ``revoke``, ``join``),
and every ``key=value`` field of the message as its own JSON field (numbers as numbers, quoted
values unquoted). The scheduler's text lines are written as ``event key=value ...`` precisely so
that one formatter serves both outputs; a message's fields never replace the base keys (they get
a ``field_`` prefix instead).

    >>> import logging
    >>> rec = logging.LogRecord("gpushare", logging.INFO, "", 0,
    ...                         "grant client=%s restore=%d waited_ms=%s", ("k1", 1, "2.5"), None)
    >>> doc = json.loads(JsonFormatter().format(rec))
    >>> doc["event"], doc["client"], doc["restore"], doc["waited_ms"]
    ('grant', 'k1', 1, 2.5)
"""

from __future__ import annotations

import ast
import json
import logging
import re
import time
from typing import Any

from ..protocol import printable

__all__ = ["JsonFormatter", "PrintableFilter", "escape_log"]

_PAIR = re.compile(
    r"(?<![\w=])([a-z][a-z0-9_]*)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s,;)]+)"
)
_EVENT = re.compile(r"([a-z][a-z_]*) \S+=")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_BASE = ("ts", "level", "logger", "message", "event", "exception")


def _value(raw: str) -> Any:
    if raw[:1] in ("'", '"'):
        try:
            return ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw[1:-1]
    if _NUMBER.fullmatch(raw):
        return float(raw) if any(ch in raw for ch in ".eE") else int(raw)
    return raw


class JsonFormatter(logging.Formatter):
    """Formats each record as one JSON object (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        doc: dict[str, Any] = {
            "ts": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": message,
        }
        match = _EVENT.match(message)
        if match:
            doc["event"] = match.group(1)
        for key, raw in _PAIR.findall(message):
            doc[f"field_{key}" if key in _BASE else key] = _value(raw)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


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
