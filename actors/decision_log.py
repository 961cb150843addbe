"""DecisionLog: the actor that appends every decision's inputs to a framed, size-bounded, rotated file.

Requests hand their :class:`~router.decision_record.DecisionRecord` over with :meth:`submit`, a
``send_nowait`` into a bounded inbox: a full inbox drops the record and counts it, so the log never
delays an answer. ``run`` takes records in batches and gives each batch to a worker thread, which
encodes it and writes it (encoding JSON and writing a file never run on the event loop).

Rotation keeps the disk use bounded: a file never grows past ``decision_log_max_bytes``; the next
frame that would not fit starts a new file (``PATH`` → ``PATH.1`` → … up to ``decision_log_files``
files, the oldest deleted). Every file starts with the magic and a header frame, so each one replays
on its own. A (re)started actor rotates the file it finds, so a header always describes the frames
after it.

A stopping actor writes what it still holds for at most ``STOP_WRITE_S`` (real time): a disk that
does not return must not hold a shutdown or a restart. A writer call is abandoned when cancelled
(its thread runs on, the file's lock keeping the next call out until it returns); what the disk has
not taken by the bound is dropped and counted.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import IO, Any

import trio
from outcome import Outcome

from router.config import RouterConfig
from router.decision_record import (
    FRAME_HEAD,
    KIND_DECISION,
    KIND_FLEET,
    KIND_HEADER,
    MAGIC,
    MAX_FRAME_BYTES,
    DecisionRecord,
    encode_decision,
    encode_fleet,
    frame,
    unusable_log_path,
)
from router.files import open_regular_file
from router.policy.plan import Fleet
from router.problems import Problem, refuse

log = logging.getLogger(__name__)

_BATCH = 256  # records a thread writes in one piece at most
# A stopping actor waits this long (real time) for its last writes and the file's close; what the
# disk has not taken by then is dropped (counted), the piece it holds left to its thread.
STOP_WRITE_S = 2.0
# The actor's writer calls on threads at once (a stop's own thread aside): the one running and those
# a hung disk holds after a cancellation abandoned them; beyond them a call waits in trio, where it
# can be cancelled.
_DISK_THREADS = 4


# What each file's header adds to the settings when it is written (its wall times): the most it can be.
HEADER_WALL_FIELDS_BYTES = len(',"opened_wall_s":99999999999.999,"wall_minus_trio_s":-99999999999.999999')

class NotADecisionLog(OSError):
    """What is at the log's path is not a decision log (a directory, another file): it is not touched."""


@dataclass(frozen=True, slots=True)
class DecisionLogHealth:
    path: str
    written: int  # flushed to the file
    dropped: int  # the inbox was full, or a stop's STOP_WRITE_S ended before the disk took them
    lost: int  # in a batch a write error ended (some of it may be on disk, the last one torn)
    oversize: int  # one decision larger than a whole file: not written
    write_errors: int
    last_error: str | None
    bytes_current: int
    rotations: int
    inbox_depth: int
    inbox_capacity: int


class LogFileWriter:
    """The file side: touched only from the log actor's worker-thread calls (``open``, ``drain``), one
    at a time: each holds the lock, so a call a cancellation abandoned keeps the next one out."""

    def __init__(self, path: str, *, max_bytes: int, files: int, header: Mapping[str, Any]) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.files = files
        self._header_fields = dict(header)
        self._header = MAGIC + frame(KIND_HEADER, header)  # the current file's (see _start)
        # The wall clock less the trio clock, set by the actor on the trio thread: each file's header
        # carries it, so a decision's receipt (``t``, trio time) reads as a time of day.
        self.wall_minus_trio_s: float | None = None
        self._file: IO[bytes] | None = None
        self._fleet: Fleet | None = None  # the fleet the current file last described
        self._fleet_id = 0
        self.size = 0
        self.written = 0
        self.lost = 0
        self.oversize = 0
        self.rotations = 0
        self.write_errors = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self.generation = 0  # one per open(): a run of the actor
        self._started: tuple[int, int] | None = None  # the file this writer last started (device, inode)

    def open(self) -> None:
        """Start a fresh file: whatever a previous run left at ``path`` is rotated away first, unless it
        is the file this writer started, as it left it: a restarted run writes on in it (the same
        process, the same header), or every crash would rotate a file away and a crash loop would
        delete the files kept."""
        with self._lock:
            self.generation += 1
            if not self._resume():
                self._open()

    def _resume(self) -> bool:
        """Reopen for appending the file this writer last started, if it is still at ``path`` and as
        long as this writer made it (no torn write, nobody else's bytes)."""
        started = self._started
        if started is None:
            return False
        self.close()
        # Without blocking or creating: a FIFO put at PATH meanwhile would hold a plain open until
        # something read it (ENXIO instead), and a PATH removed meanwhile is not resumed.
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            ours = os.fstat(fd)
            resumable = (
                stat.S_ISREG(ours.st_mode) and (ours.st_dev, ours.st_ino) == started and ours.st_size == self.size
            )
            if resumable:
                self._file = os.fdopen(fd, "ab")
                return True
        except OSError:
            pass
        os.close(fd)
        return False

    def drain(self, pieces: deque[list[DecisionRecord]], *, close_generation: int | None = None) -> None:
        """Write the pieces, each taken from the left of ``pieces`` just before it is written (the
        trio thread takes back those left when it stops waiting); then, with ``close_generation``,
        close the file if it is still that run's (a stop that gave up on a hung disk returns late,
        maybe after a restarted run opened its own file)."""
        with self._lock:
            while True:
                try:
                    records = pieces.popleft()
                except IndexError:
                    break
                self._write(records)
            if close_generation is not None and close_generation == self.generation:
                self.close()

    def _open(self) -> None:
        try:
            self.close()  # a stop that gave up on a hung disk may have left it open
            unusable = unusable_log_path(self.path)
            if unusable is not None:  # never rotate away (or overwrite) what is not ours
                raise NotADecisionLog(f"{unusable}: left as it is")
            if _holds_decisions(self.path):  # a file with no decision in it is not worth a rotated name
                self._shift()
            self._start()
        except OSError as exc:
            self._failed(exc)

    def _write(self, records: Sequence[DecisionRecord]) -> None:
        appended = 0
        try:
            if self._file is not None and not self._still_at_path():
                self.close()  # opened again below, not rotated: what is at the path now is not this file
            if self._file is None:
                self._open()
                if self._file is None:
                    self.lost += len(records)
                    return
            for record in records:
                appended += self._append(record)
            assert self._file is not None
            self._file.flush()
        except OSError as exc:
            # Which of the batch reached the disk is unknown (the last may be torn): all of it is
            # counted lost, none written. The next write starts a new file; a reader reads a torn
            # file up to its torn frame.
            self.lost += len(records)
            self._failed(exc)
        else:
            self.written += appended

    def _still_at_path(self) -> bool:
        """Whether the open file is still the one at ``path`` as written: deleted (or its directory) or
        replaced, records went on into a file nobody can read, counted written, and the next rotation's
        rename failed and lost a whole batch. Shortened under it (logrotate's ``copytruncate``, ``: >
        PATH``), records went on at the old offset after a run of zero bytes and no header: a file no
        reader takes, which the next rotations then refused to move, losing every batch after."""
        assert self._file is not None
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        ours = os.fstat(self._file.fileno())
        return (at_path.st_dev, at_path.st_ino) == (ours.st_dev, ours.st_ino) and ours.st_size >= self.size

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, record: DecisionRecord) -> int:
        """Write ``record``'s frames; 1, or 0 when it is larger than a whole file or than a frame a
        reader takes (counted oversize)."""
        fleet = record.scorings[0].fleet if record.scorings else None
        frames = self._frames(record, fleet)
        if frames is None or len(self._header) + len(frames) > self.max_bytes:
            self.oversize += 1
            return 0
        if self.size + len(frames) > self.max_bytes:
            self.rotations += 1
            self.close()
            self._shift()
            self._start()
            frames = self._frames(record, fleet)  # a new file describes its fleet again
            if frames is None or len(self._header) + len(frames) > self.max_bytes:  # with its fleet it does not fit
                self.oversize += 1
                return 0
        assert self._file is not None
        self._file.write(frames)
        self.size += len(frames)
        if fleet is not None:
            self._fleet = fleet
        return 1

    def _frames(self, record: DecisionRecord, fleet: Fleet | None) -> bytes | None:
        """The record's frames (its fleet's first when the file has not described it); None when one
        is larger than a reader takes (``MAX_FRAME_BYTES``): written, it would make the file unreadable."""
        out = b""
        if fleet is not None and fleet is not self._fleet:
            self._fleet_id += 1
            out = frame(KIND_FLEET, encode_fleet(self._fleet_id, fleet))
        decision = frame(KIND_DECISION, encode_decision(record, self._fleet_id if fleet is not None else None))
        if max(len(out), len(decision)) - FRAME_HEAD.size > MAX_FRAME_BYTES:
            return None
        return out + decision

    def _start(self) -> None:
        fields: dict[str, Any] = {**self._header_fields, "opened_wall_s": round(time.time(), 3)}
        if self.wall_minus_trio_s is not None:
            fields["wall_minus_trio_s"] = round(self.wall_minus_trio_s, 6)
        self._header = MAGIC + frame(KIND_HEADER, fields)
        self._file = open(self.path, "wb")  # noqa: SIM115 - kept open across batches, closed by close()
        self._file.write(self._header)
        self._file.flush()
        self.size = len(self._header)
        self._fleet = None
        started = os.fstat(self._file.fileno())
        self._started = (started.st_dev, started.st_ino)

    def _shift(self) -> None:
        """PATH → PATH.1 → … ; the oldest beyond ``files`` is deleted (one file: PATH is replaced).
        Every rotated name is looked at first: what is not a decision log is neither deleted nor
        replaced (NotADecisionLog, and nothing moves)."""
        if self.files <= 1:
            return
        for index in range(1, self.files):
            rotated = f"{self.path}.{index}"
            unusable = unusable_log_path(rotated)
            if unusable is not None:
                raise NotADecisionLog(f"{rotated} {unusable}: left as it is")
        oldest = f"{self.path}.{self.files - 1}"
        if os.path.exists(oldest):
            os.remove(oldest)
        for index in range(self.files - 2, 0, -1):
            older = f"{self.path}.{index}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{index + 1}")
        os.replace(self.path, f"{self.path}.1")

    def _failed(self, exc: OSError) -> None:
        self.write_errors += 1
        self.last_error = f"{self.path}: {exc.strerror or exc}"
        if self.write_errors == 1:  # the first says why; the count and the last are in /debug/actors
            log.warning("decision log: cannot write %s (%s); decisions are not logged until it can", self.path, exc)
        try:
            self.close()
        except OSError:
            self._file = None


def _holds_decisions(path: str) -> bool:
    """Whether the log at ``path`` holds more than its header frame (a run that logged nothing
    leaves only the header)."""
    try:
        with open_regular_file(path) as file:
            head = file.read(len(MAGIC) + FRAME_HEAD.size)
            size = os.fstat(file.fileno()).st_size
    except FileNotFoundError:
        return False
    if len(head) < len(MAGIC) + FRAME_HEAD.size:
        return size > 0  # a torn header: keep it for a look
    header_length: int = FRAME_HEAD.unpack_from(head, len(MAGIC))[0]
    return size > len(MAGIC) + FRAME_HEAD.size + header_length


class DecisionLog:
    def __init__(self, config: RouterConfig, header: Mapping[str, Any]) -> None:
        # The header records the settings given, and a long --workers list can make it larger than a
        # file may be: every file then broke the bound at its first write, and every decision was
        # dropped as oversize. Half a file at most, so a file holds decisions too.
        header_bytes = len(MAGIC) + len(frame(KIND_HEADER, header)) + HEADER_WALL_FIELDS_BYTES
        if 2 * header_bytes > config.decision_log_max_bytes:
            # Rounded up to whole KiB with room: the header records this setting too, its digits with it.
            enough = -(-(2 * header_bytes + 64) // 1024) * 1024
            refuse("router", [Problem(
                ("decision_log_max_bytes",),
                f"each file's header, which records the settings given, takes {header_bytes} bytes, over half "
                f"of {config.decision_log_max_bytes}: give at least {enough}",
            )])
        self._config = config
        self._send, self._receive = trio.open_memory_channel[DecisionRecord](config.decision_log_inbox_size)
        self._writer = LogFileWriter(
            config.decision_log, max_bytes=config.decision_log_max_bytes, files=config.decision_log_files, header=header
        )
        self._dropped = 0
        self._threads = trio.CapacityLimiter(_DISK_THREADS)

    def submit(self, record: DecisionRecord) -> bool:
        """Queue ``record`` for writing; never blocks. False (and counted) when the inbox is full."""
        try:
            self._send.send_nowait(record)
        except trio.WouldBlock:
            self._dropped += 1
            return False
        return True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        writer = self._writer
        writer.wall_minus_trio_s = time.time() - trio.current_time()
        await self._on_disk(writer.open)
        task_status.started()
        # Pieces handed to the writer's thread, each taken from the left when it is written: what a
        # cancellation left here (before a thread took it) is the stop's to write.
        pieces: deque[list[DecisionRecord]] = deque()
        try:
            async for first in self._receive:
                batch = [first]
                while len(batch) < _BATCH:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                pieces.append(batch)
                await self._on_disk(partial(writer.drain, pieces))
        finally:
            # Stopping (shutdown or a restart): the pieces left and whatever is queued are written
            # before the file closes, within STOP_WRITE_S; a disk that has not returned by then keeps
            # the piece it holds and the rest is dropped.
            batch = []
            while True:
                try:
                    batch.append(self._receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                if len(batch) == _BATCH:
                    pieces.append(batch)
                    batch = []
            if batch:
                pieces.append(batch)
            with trio.CancelScope(shield=True):
                finished = await self._finish(pieces)
            while True:
                try:
                    self._dropped += len(pieces.popleft())
                except IndexError:
                    break
            if finished is not None:
                finished.unwrap()  # what the thread raised (a close that failed)

    async def _finish(self, pieces: deque[list[DecisionRecord]]) -> Outcome[None] | None:
        """Write ``pieces`` and close the file on a thread of their own, waiting STOP_WRITE_S for it at
        most; None: the disk has not returned (the thread takes no piece after the trio thread took
        the rest back, and closes the file when its piece is done)."""
        finished: list[Outcome[None]] = []
        done = threading.Event()

        def deliver(result: Outcome[None]) -> None:
            finished.append(result)
            done.set()

        writer = self._writer
        trio.lowlevel.start_thread_soon(partial(writer.drain, pieces, close_generation=writer.generation), deliver)
        # The bound is on the real clock, waited out on a thread: the disk is not on trio's clock, and
        # under a MockClock a trio deadline would end the wait for any thread at once. The wait has a
        # limiter of its own, so no thread another call holds delays it.
        await trio.to_thread.run_sync(done.wait, STOP_WRITE_S, limiter=trio.CapacityLimiter(1))
        return finished[0] if finished else None

    async def _on_disk(self, call: Callable[[], None]) -> None:
        # Abandoned when cancelled: a disk that does not return then holds a thread, never the actor.
        await trio.to_thread.run_sync(call, limiter=self._threads, abandon_on_cancel=True)

    def health(self) -> DecisionLogHealth:
        w = self._writer
        return DecisionLogHealth(
            path=w.path,
            written=w.written,
            dropped=self._dropped,
            lost=w.lost,
            oversize=w.oversize,
            write_errors=w.write_errors,
            last_error=w.last_error,
            bytes_current=w.size,
            rotations=w.rotations,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._config.decision_log_inbox_size,
        )
