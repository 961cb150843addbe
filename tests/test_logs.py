"""Logging: key=value context in text and JSON, aggregated hot-path warnings, once-per-key messages."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from router.logs import AggregatingLogger, ctx, setup_logging, shown
from router.types import Reason


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, ListHandler]]:
    logger = logging.getLogger("kvroute.test.logs")
    handler = ListHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, handler
    logger.removeHandler(handler)


def test_text_format_appends_context(restore_root_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("info", "text", stream)
    log = logging.getLogger("kvroute.test.text")
    log.debug("hidden at INFO")
    log.warning("probe failed", extra=ctx(target="10.0.0.1:8001", reason=Reason.KVCM_ERROR, note="two words"))
    (line,) = stream.getvalue().splitlines()
    assert line.endswith(
        'WARNING kvroute.test.text: probe failed target=10.0.0.1:8001 reason=kvcm_error note="two words"'
    )
    assert line[:4].isdigit() and line[19:24].startswith(".")


def test_text_format_escapes_a_context_value_a_terminal_would_act_on(restore_root_logging: None) -> None:
    """A request id is the client's text: an escape sequence, a NUL or a right-to-left override in it
    reaches the line escaped, never raw."""
    stream = io.StringIO()
    setup_logging("info", "text", stream)
    spoof = "req\x1b[2K\x1b[1Gfake\u202eevil\x00\x7f"
    extra = ctx(request_id=spoof, plain="r-1", wide="请求", spaced="请求 1", quote='a"b\\c')
    logging.getLogger("kvroute.test.text").warning("m", extra=extra)
    (line,) = stream.getvalue().splitlines()
    assert line.endswith(
        'm request_id="req\\u001b[2K\\u001b[1Gfake\\u202eevil\\u0000\\u007f" plain=r-1 wide=请求 '
        'spaced="请求 1" quote="a\\"b\\\\c"'
    )
    assert all(c.isprintable() for c in line)


def test_text_format_keeps_a_message_carrying_a_peers_text_on_its_line(restore_root_logging: None) -> None:
    """A message carries a peer's text (KVCM's refusal of a query, up to 1,024 characters of its own):
    a newline in it began a line that read as a record of ours, timestamp, level and all. Only the
    traceback that follows a message is a line of its own."""
    stream = io.StringIO()
    setup_logging("info", "text", stream)
    forged = "nope\n2030-01-01T00:00:00.000Z CRITICAL kvroute.auth: admin login granted\x1b[2K"
    logger = logging.getLogger("kvroute.test.text")
    logger.warning("kvcm_query_failed: %s", forged, extra=ctx(reason="kvcm_query_failed"))
    (line,) = stream.getvalue().splitlines()
    assert line.endswith(
        "kvcm_query_failed: nope\\u000a2030-01-01T00:00:00.000Z CRITICAL kvroute.auth: admin login granted"
        "\\u001b[2K reason=kvcm_query_failed"
    )
    try:
        raise ValueError("x")
    except ValueError:
        logger.exception("failed: %s", "a\rb")
    first, *traceback = stream.getvalue().splitlines()[1:]
    assert first.endswith("failed: a\\u000db") and traceback[0] == "Traceback (most recent call last):"


def test_json_format_is_one_object_per_line_with_context_and_exception(restore_root_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("DEBUG", "json", stream)
    log = logging.getLogger("kvroute.test.json")
    log.debug("decided", extra=ctx(request_id="r1", reason=Reason.NO_POSITIVE_MATCH, msg="clash"))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("crashed", extra=ctx(actor="prober"))
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert {k: first[k] for k in ("level", "logger", "msg", "request_id", "reason", "ctx_msg")} == {
        "level": "DEBUG",
        "logger": "kvroute.test.json",
        "msg": "decided",
        "request_id": "r1",
        "reason": "no_positive_match",
        "ctx_msg": "clash",
    }
    assert first["ts"].endswith("Z")
    assert second["actor"] == "prober" and "RuntimeError: boom" in second["exc"]


def test_json_format_redacts_an_addresss_credentials_in_the_message(restore_root_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("INFO", "json", stream)
    logging.getLogger("kvroute.test.json").warning("peer %s failed", "ops:s3cr3t@10.0.0.9:80")
    assert "s3cr3t" not in stream.getvalue()
    (line,) = stream.getvalue().splitlines()
    assert json.loads(line)["msg"] == "peer <redacted>@10.0.0.9:80 failed"


def test_setup_logging_replaces_its_own_handler_and_rejects_bad_values(restore_root_logging: None) -> None:
    root = logging.getLogger()
    # Another test in the same process may have called setup_logging already: count the others.
    others = [h for h in root.handlers if type(h).__name__ != "_KvrouteHandler"]
    setup_logging("INFO", "text", io.StringIO())
    setup_logging("WARNING", "json", io.StringIO())
    ours = [h for h in root.handlers if type(h).__name__ == "_KvrouteHandler"]
    assert len(ours) == 1
    assert [h for h in root.handlers if h not in ours] == others
    assert root.level == logging.WARNING
    with pytest.raises(ValueError, match="--log-level"):
        setup_logging("LOUD", "text")
    with pytest.raises(ValueError, match="--log-format"):
        setup_logging("INFO", "xml")


def test_aggregation_logs_first_then_the_total_once_per_interval(
    captured: tuple[logging.Logger, ListHandler],
) -> None:
    logger, handler = captured
    agg = AggregatingLogger(logger, interval_s=60.0, max_keys=16)
    agg.note(Reason.NO_POSITIVE_MATCH, 0.0, "KVCM matched no worker", request_id="r0")
    for i in range(311):
        agg.note(Reason.NO_POSITIVE_MATCH, 0.1 + i * 0.1, request_id=f"r{i + 1}")
    agg.note("breaker_open", 5.0)
    assert handler.messages == ["no_positive_match: KVCM matched no worker", "breaker_open"]
    assert handler.records[0].__dict__["kvroute_context"] == {
        "reason": "no_positive_match",
        "request_id": "r0",
    }
    assert agg.next_due() == 60.0
    agg.flush(59.9)
    assert len(handler.messages) == 2
    agg.flush(60.0)
    # The total says what it counts: the window's first message.
    assert handler.messages[2:] == ["312 no_positive_match in the last 60 s (the first: KVCM matched no worker)"]
    agg.flush(65.0)  # breaker_open happened once: no total line
    assert len(handler.messages) == 3
    assert agg.tracked_keys == 0
    agg.note(Reason.NO_POSITIVE_MATCH, 61.0)
    assert handler.messages[3:] == ["no_positive_match"]


def test_the_first_occurrence_of_a_window_is_logged_with_its_traceback(
    captured: tuple[logging.Logger, ListHandler],
) -> None:
    logger, handler = captured
    agg = AggregatingLogger(logger, interval_s=60.0, max_keys=16)
    error = RuntimeError("probe exploded")
    agg.note("probe_failed", 0.0, "x", exc_info=error)
    agg.note("probe_failed", 1.0, "x", exc_info=error)  # counted, not logged
    (first,) = handler.records
    assert first.exc_info is not None and first.exc_info[1] is error


def test_a_late_occurrence_closes_the_old_window_itself(captured: tuple[logging.Logger, ListHandler]) -> None:
    logger, handler = captured
    agg = AggregatingLogger(logger, interval_s=10.0, max_keys=16)
    for t in (0.0, 1.0, 2.0):
        agg.note("deadline", t)
    agg.note("deadline", 15.0)  # no flush happened in between
    assert handler.messages == ["deadline", "3 deadline in the last 10 s", "deadline"]


def test_key_bound_flushes_the_oldest_window_early(captured: tuple[logging.Logger, ListHandler]) -> None:
    logger, handler = captured
    agg = AggregatingLogger(logger, interval_s=60.0, max_keys=2)
    agg.note("a", 0.0)
    agg.note("a", 1.0)
    agg.note("b", 2.0)
    agg.note("c", 3.0)  # evicts "a", whose total is logged now
    assert handler.messages == ["a", "b", "2 a in the last 3 s", "c"]
    assert agg.tracked_keys == 2


async def test_run_logs_each_total_when_due(
    autojump_clock: trio.testing.MockClock, captured: tuple[logging.Logger, ListHandler]
) -> None:
    logger, handler = captured
    agg = AggregatingLogger(logger, interval_s=60.0, max_keys=16)
    logged_at: dict[str, float] = {}

    class Stamp(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged_at[record.getMessage()] = trio.current_time()

    stamp = Stamp()
    logger.addHandler(stamp)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(agg.run)
            start = trio.current_time()
            agg.note("a", start)
            await trio.sleep(20)
            agg.note("b", start + 20)
            agg.note("b", start + 20)
            await trio.sleep(5)
            agg.note("a", start + 25)  # "a" now has a total due at start+60, before "b"'s at start+80
            await trio.sleep(100)
            nursery.cancel_scope.cancel()
    finally:
        logger.removeHandler(stamp)
    assert handler.messages == ["a", "b", "2 a in the last 60 s", "2 b in the last 60 s"]
    assert logged_at["2 a in the last 60 s"] == pytest.approx(start + 60)
    assert logged_at["2 b in the last 60 s"] == pytest.approx(start + 80)


def test_a_request_id_is_shown_on_one_line_whatever_it_holds() -> None:
    """Replay, explain and route print request ids: an unpaired surrogate made replay's print raise
    UnicodeEncodeError (every later decision unreported), a newline split its line."""
    assert shown("plain-id") == "plain-id"
    assert shown("prénom-ü") == "prénom-ü"  # printable text of any script stays
    for odd in ("bad\ud800id", "two\nlines", "bell\x07"):
        text = shown(odd)
        text.encode("utf-8")  # printable on any UTF-8 terminal
        assert "\n" not in text and text.startswith('"') and text.isprintable()

