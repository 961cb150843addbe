"""The selection ledger: each worker's last-selected time and local pre-charge, bounded.

Pure state with time passed in; it belongs to the policy, which belongs to the Scorer actor.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Collection

NEVER = -math.inf  # last-selected time of a worker never selected: sorts first (preferred)


class _LedgerEntry:
    """One worker's last-selected time and charges.

    Charges are kept as parallel lists of times and running totals, live from ``head``:
    ``cums[i]`` is every token charged up to and including charge ``i``, ``base`` the total
    of the charges a status has cleared, ``total`` of all. So the pending tokens since ``t``
    are ``total`` minus the running total just before the first charge made at or after
    ``t`` — one bisection, however many charges a stale status has let pile up
    (:meth:`SelectionLedger.view`, once per candidate per decision, reads them in place).
    """

    __slots__ = ("base", "cums", "head", "last_selected", "newest_status", "times", "total")

    def __init__(self) -> None:
        self.last_selected = NEVER
        self.times: list[float] = []
        self.cums: list[int] = []
        self.head = 0
        self.base = 0
        self.total = 0
        self.newest_status = NEVER  # the latest time a status recorded with was taken

    def live(self) -> int:
        """Charges whose time is still kept (not cleared by a status nor forgotten)."""
        return len(self.times) - self.head

    def clear_before(self, since: float) -> None:
        k = bisect_left(self.times, since, self.head)
        if k > self.head:
            self.base = self.cums[k - 1]
            self.head = k

    def charge(self, now: float, tokens: int, max_charges: int) -> None:
        if self.times and now < self.times[-1]:
            now = self.times[-1]  # keep times sorted if a caller's clock steps back
        self.total += tokens
        self.times.append(now)
        self.cums.append(self.total)
        if len(self.times) - self.head > max_charges:
            # Forget the oldest charge's time. A status taken after it covers its tokens: they go, as a
            # clear would take them (a status older than that is then charged less than it should
            # be, as one older than the horizon is). Else its tokens stay (base is unchanged), counted
            # for every status older than the charges kept, until one covers them: over-estimating
            # load spreads more; it never piles on.
            if self.times[self.head] < self.newest_status:
                self.base = self.cums[self.head]
            self.head += 1
        if self.head > max_charges:
            del self.times[: self.head]
            del self.cums[: self.head]
            self.head = 0


class SelectionLedger:
    """Per-worker last-selected time and local pre-charge, bounded (LRU over workers).

    Pre-charge rule: a charge carries the time it was made; a status taken at ``t`` already
    reflects the dispatches made before ``t``, so only charges made at or after ``t`` are added
    to that status's work. Statuses a worker is scored with do not only get newer: a request
    may hold a cached status while it waits for its other probes, and a decision scored with a
    newer one is recorded meanwhile. So recording with a status taken at ``t`` forgets only the
    charges made before ``t - status_horizon_s``: a status up to that much older than the newest
    is still charged every dispatch made since it was taken.

    A worker evicted from the ledger is treated as never selected and uncharged.
    """

    def __init__(self, max_tracked_workers: int, max_pending_charges: int, *, status_horizon_s: float) -> None:
        if max_tracked_workers < 1:
            raise ValueError(f"max_tracked_workers: must be >= 1, got {max_tracked_workers}")
        if max_pending_charges < 1:
            raise ValueError(f"max_pending_charges: must be >= 1, got {max_pending_charges}")
        if not status_horizon_s >= 0.0:
            raise ValueError(f"status_horizon_s: must be >= 0, got {status_horizon_s}")
        self._max_workers = max_tracked_workers
        self._max_charges = max_pending_charges
        self._status_horizon_s = status_horizon_s
        self._entries: OrderedDict[str, _LedgerEntry] = OrderedDict()  # by worker http target
        self._pending_charges = 0  # live charges over every entry, kept as entries change

    def __len__(self) -> int:
        return len(self._entries)

    def view(self, worker: str, status_taken_at: float) -> tuple[int, float]:
        """(pending tokens since ``status_taken_at``, last-selected time) in one lookup."""
        entry = self._entries.get(worker)
        if entry is None:
            return 0, NEVER
        head = entry.head
        k = bisect_left(entry.times, status_taken_at, head)
        return entry.total - (entry.base if k == head else entry.cums[k - 1]), entry.last_selected

    def record(self, worker: str, uncached_tokens: int, now: float, status_taken_at: float | None = None) -> None:
        """Charge ``uncached_tokens`` to ``worker`` (its http target) at ``now``; mark it
        selected at ``now``.

        ``status_taken_at`` (the status the selection was made with, if any) clears the
        charges made more than ``status_horizon_s`` before it.
        """
        entry = self._entries.get(worker)
        if entry is None:
            entry = self._entries[worker] = _LedgerEntry()
            if len(self._entries) > self._max_workers:
                _, evicted = self._entries.popitem(last=False)
                self._pending_charges -= evicted.live()
        else:
            self._entries.move_to_end(worker)
        before = entry.live()
        if status_taken_at is not None:
            if status_taken_at > entry.newest_status:
                entry.newest_status = status_taken_at
            entry.clear_before(status_taken_at - self._status_horizon_s)
        entry.charge(now, uncached_tokens if uncached_tokens > 0 else 0, self._max_charges)
        if now > entry.last_selected:
            entry.last_selected = now
        self._pending_charges += entry.live() - before

    def retain(self, workers: Collection[str]) -> None:
        """Forget every worker not in ``workers`` (http targets): those discovery lists no more, whose
        entries would otherwise stay until as many newer workers pushed them out."""
        for worker in [w for w in self._entries if w not in workers]:
            self._pending_charges -= self._entries.pop(worker).live()

    def pending_charges(self) -> int:
        """Charges kept over every tracked worker: cleared only as their worker is recorded again (or
        forgotten), and only those made ``status_horizon_s`` before its status, so it counts charges
        a newer status already covers, which scoring with that status ignores."""
        return self._pending_charges
