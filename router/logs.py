"""Logging: standard ``logging`` with key=value context, text or JSON lines, and hot-path helpers.

- ``logger.warning("probe failed", extra=ctx(target=t, reason="probe_failed"))`` attaches structured
  context; the text format appends ``target=… reason=…``, the JSON format adds the keys.
- :class:`AggregatingLogger` is for warnings that can fire per request: the first occurrence of a
  reason in an interval is logged with its context, the rest are only counted, and the count is logged
  once the interval is over, with the first one's message ("312 no_positive_match in the last 60 s
  (the first: KVCM matched no worker)").

Both formats replace the userinfo of any address in a line (``user:password@host`` →
``<redacted>@host``), whichever message or context value carried it.

Reason keys are the metric label values (enum members are logged by their value). The helper keeps a
bounded map and takes time as an argument (the trio clock), so it is deterministic under MockClock.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

import trio

from router.targets import redact_userinfo
from router.text import escaped_char, one_line

CONTEXT_ATTR = "kvroute_context"
_BASE_KEYS = frozenset({"ts", "level", "logger", "msg", "exc"})


def ctx(**fields: object) -> dict[str, object]:
    """The ``extra=`` of a log call carrying key=value context."""
    return {CONTEXT_ATTR: fields}


def _context(record: logging.LogRecord) -> Mapping[str, object]:
    fields = record.__dict__.get(CONTEXT_ATTR)
    return fields if isinstance(fields, Mapping) else {}


def _plain(value: object) -> object:
    return value.value if isinstance(value, enum.Enum) else value


def _text_value(value: object) -> str:
    text = str(_plain(value))
    # Quoted when it holds a separator; a character a terminal would act on or render deceptively
    # (control and format characters: context values can be a client's text) is escaped, printable
    # text of any script is kept as it is, quoted or not.
    if text and all(c.isprintable() and not c.isspace() and c not in '="' for c in text):
        return text
    return '"' + "".join(escaped_char(c) for c in text) + '"'


def shown(text: str) -> str:
    """``text`` for one line of a terminal: as it is when plain, else quoted with control, format and
    unpaired surrogate characters escaped (a client's request id can hold any of them)."""
    return _text_value(text)


def _timestamp(record: logging.LogRecord) -> str:
    # Wall-clock time for the reader; policy never reads it.
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """``2025-01-02T03:04:05.678Z WARNING actors.worker_prober: probe failed target=10.0.0.1:8001``"""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {one_line(record.getMessage())}"
        fields = _context(record)
        if fields:
            line += " " + " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact_userinfo(line)  # an address's credentials never reach the log


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the context keys, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _context(record).items():
            out[f"ctx_{key}" if key in _BASE_KEYS else key] = _plain(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return redact_userinfo(json.dumps(out, default=str))  # an address's credentials never reach the log


class _KvrouteHandler(logging.StreamHandler[TextIO]):
    """Marks the handler setup_logging installed, so a second call replaces it instead of adding one."""


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # any case
LOG_FORMATS = ("text", "json")  # any case


def setup_logging(level: str, fmt: str, stream: TextIO | None = None) -> logging.Handler:
    """Configure the root logger: ``level`` one of LOG_LEVELS, ``fmt`` one of LOG_FORMATS; returns the handler."""
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"--log-level: expected {'|'.join(LOG_LEVELS)}, got {level!r}")
    numeric = logging.getLevelNamesMapping()[level.upper()]
    fmt = fmt.lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format: expected {'|'.join(LOG_FORMATS)}, got {fmt!r}")
    formatters: dict[str, logging.Formatter] = {"text": TextFormatter(), "json": JsonFormatter()}
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _KvrouteHandler)]:
        root.removeHandler(old)
    handler = _KvrouteHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatters[fmt])
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler


class _Tag(logging.Filter):
    """Adds fixed context fields to every record its handler formats; a record's own fields win."""

    def __init__(self, fields: Mapping[str, object]) -> None:
        super().__init__()
        self._fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__[CONTEXT_ATTR] = {**self._fields, **_context(record)}
        return True


def tag_records(handler: logging.Handler, **fields: object) -> None:
    """Every line ``handler`` writes carries ``fields`` (e.g. which of several router processes wrote it)."""
    handler.addFilter(_Tag(fields))


def _key(reason: str | enum.Enum) -> str:
    return str(reason.value) if isinstance(reason, enum.Enum) else reason


@dataclass(slots=True)
class _Window:
    start: float
    count: int  # occurrences in the window, the logged first one included
    message: str  # the first one's: the total says what the count is of


class AggregatingLogger:
    """Rate-limited, aggregated warnings keyed by reason.

    Per key: the first occurrence in an interval is logged at once (with its context); later ones in
    the same interval are counted; when the interval is over the total is logged once
    ("312 no_positive_match in the last 60 s"). :meth:`flush` logs the totals that are due; :meth:`run`
    does it on time in the background. At most ``max_keys`` keys are tracked: the least recently
    started window is flushed early to make room. All methods except run are synchronous and do not
    await, so calls from any task are atomic under trio's cooperative scheduling.
    """

    def __init__(
        self, logger: logging.Logger, interval_s: float, max_keys: int, level: int = logging.WARNING
    ) -> None:
        if interval_s <= 0 or max_keys < 1:
            raise ValueError("AggregatingLogger: interval_s must be > 0 and max_keys >= 1")
        self._logger = logger
        self._interval = interval_s
        self._max_keys = max_keys
        self._level = level
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._due_changed = trio.Event()

    def note(
        self,
        reason: str | enum.Enum,
        now: float,
        message: str = "",
        *,
        exc_info: BaseException | None = None,
        **context: object,
    ) -> None:
        """One occurrence of ``reason`` at trio time ``now``; ``exc_info``: logged with the first of a
        window (the later ones are counted)."""
        key = _key(reason)
        window = self._windows.get(key)
        if window is not None and now < window.start + self._interval:
            window.count += 1
            if window.count == 2:
                self._due_changed.set()  # this window now has a total to log when it ends
            return
        if window is not None:
            self._emit_total(key, window, now)
            del self._windows[key]
        elif len(self._windows) >= self._max_keys:
            oldest_key, oldest = self._windows.popitem(last=False)
            self._emit_total(oldest_key, oldest, now)
        self._windows[key] = _Window(now, 1, message)
        text = f"{key}: {message}" if message else key
        self._logger.log(self._level, text, exc_info=exc_info, extra=ctx(reason=key, **context))

    def flush(self, now: float) -> None:
        """Log the totals of every window that has ended by ``now`` and forget those windows."""
        for key, window in list(self._windows.items()):
            if now >= window.start + self._interval:
                self._emit_total(key, window, now)
                del self._windows[key]

    def next_due(self) -> float | None:
        """When the next total is due (None: nothing to log)."""
        ends = [w.start + self._interval for w in self._windows.values() if w.count > 1]
        return min(ends) if ends else None

    @property
    def tracked_keys(self) -> int:
        return len(self._windows)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Log each total when its window ends (sleeps until the next one is due; never polls)."""
        task_status.started()
        while True:
            self._due_changed = trio.Event()
            due = self.next_due()
            # Wake when the earliest total is due, or when a window gets a total that may be due earlier.
            with trio.move_on_at(math.inf if due is None else due):
                await self._due_changed.wait()
            self.flush(trio.current_time())

    def _emit_total(self, key: str, window: _Window, now: float) -> None:
        if window.count > 1:
            seconds = min(now - window.start, self._interval)
            self._logger.log(
                self._level,
                "%d %s in the last %.0f s%s",
                window.count,
                key,
                seconds,
                f" (the first: {window.message})" if window.message else "",
                extra=ctx(reason=key, count=window.count),
            )
