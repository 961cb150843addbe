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
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import trio

from router.config import RouterConfig
from router.decision_record import (
    KIND_DECISION,
    KIND_FLEET,
    KIND_HEADER,
    MAGIC,
    DecisionRecord,
    encode_decision,
    encode_fleet,
    frame,
)
from router.policy.plan import Fleet

_BATCH = 256  # records handed to one thread call at most


@dataclass(frozen=True, slots=True)
class DecisionLogHealth:
    path: str
    written: int
    dropped: int  # the inbox was full
    oversize: int  # one decision larger than a whole file: not written
    write_errors: int
    last_error: str | None
    bytes_current: int
    rotations: int
    inbox_depth: int
    inbox_capacity: int


class LogFileWriter:
    """The file side: touched only from the log actor's worker-thread calls, one at a time."""

    def __init__(self, path: str, *, max_bytes: int, files: int, header: Mapping[str, Any]) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.files = files
        self._header = MAGIC + frame(KIND_HEADER, header)
        self._file: IO[bytes] | None = None
        self._fleet: Fleet | None = None  # the fleet the current file last described
        self._fleet_id = 0
        self.size = 0
        self.written = 0
        self.oversize = 0
        self.rotations = 0
        self.write_errors = 0
        self.last_error: str | None = None

    def open(self) -> None:
        """Start a fresh file: whatever a previous run left at ``path`` is rotated away first."""
        try:
            if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
                self._shift()
            self._start()
        except OSError as exc:
            self._failed(exc)

    def write(self, records: Sequence[DecisionRecord]) -> None:
        try:
            if self._file is None:
                self.open()
                if self._file is None:
                    return
            for record in records:
                self._append(record)
            assert self._file is not None
            self._file.flush()
        except OSError as exc:
            self._failed(exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, record: DecisionRecord) -> None:
        fleet = record.scorings[0].fleet if record.scorings else None
        frames = self._frames(record, fleet)
        if len(self._header) + len(frames) > self.max_bytes:
            self.oversize += 1
            return
        if self.size + len(frames) > self.max_bytes:
            self.rotations += 1
            self.close()
            self._shift()
            self._start()
            frames = self._frames(record, fleet)  # a new file describes its fleet again
        assert self._file is not None
        self._file.write(frames)
        self.size += len(frames)
        self.written += 1
        if fleet is not None:
            self._fleet = fleet

    def _frames(self, record: DecisionRecord, fleet: Fleet | None) -> bytes:
        out = b""
        if fleet is not None and fleet is not self._fleet:
            self._fleet_id += 1
            out = frame(KIND_FLEET, encode_fleet(self._fleet_id, fleet))
        return out + frame(KIND_DECISION, encode_decision(record, self._fleet_id if fleet is not None else None))

    def _start(self) -> None:
        self._file = open(self.path, "wb")  # noqa: SIM115 - kept open across batches, closed by close()
        self._file.write(self._header)
        self._file.flush()
        self.size = len(self._header)
        self._fleet = None

    def _shift(self) -> None:
        """PATH → PATH.1 → … ; the oldest beyond ``files`` is deleted (one file: PATH is replaced)."""
        if self.files <= 1:
            return
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
        try:
            self.close()
        except OSError:
            self._file = None


class DecisionLog:
    def __init__(self, config: RouterConfig, header: Mapping[str, Any]) -> None:
        self._config = config
        self._send, self._receive = trio.open_memory_channel[DecisionRecord](config.decision_log_inbox_size)
        self._writer = LogFileWriter(
            config.decision_log, max_bytes=config.decision_log_max_bytes, files=config.decision_log_files, header=header
        )
        self._dropped = 0

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
        await trio.to_thread.run_sync(writer.open)
        task_status.started()
        batch: list[DecisionRecord] = []
        try:
            async for first in self._receive:
                batch = [first]
                while len(batch) < _BATCH:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                await trio.to_thread.run_sync(writer.write, batch)
                batch = []
        finally:
            # Stopping (shutdown or a restart): the batch in hand (a cancellation can come before its
            # thread starts) and whatever is queued are written before the file closes.
            while True:
                try:
                    batch.append(self._receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            with trio.CancelScope(shield=True):
                if batch:
                    await trio.to_thread.run_sync(writer.write, batch)
                await trio.to_thread.run_sync(writer.close)

    def health(self) -> DecisionLogHealth:
        w = self._writer
        return DecisionLogHealth(
            path=w.path,
            written=w.written,
            dropped=self._dropped,
            oversize=w.oversize,
            write_errors=w.write_errors,
            last_error=w.last_error,
            bytes_current=w.size,
            rotations=w.rotations,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._config.decision_log_inbox_size,
        )
