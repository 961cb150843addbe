"""CPU time of this process's threads, by role: where a figure's CPU per call goes.

``snapshot()`` reads each thread's user + system time from ``/proc/self/task/<tid>/stat`` (Linux;
elsewhere it returns nothing and the figures leave the split out) and names it by its Python
thread name where Python knows the thread, else by the kernel's (grpc's C threads, e.g.
``event_engine``). ``split()`` turns two snapshots into seconds per role, where a role is the
first of ``roles`` whose prefix the thread's name at the second snapshot starts with ("other" for
none); a thread that started between the two counts from zero. A thread that ended between them is
in neither snapshot's view at its end (grpcio starts a client spin thread for a call on an idle
channel, and it ends when the channel's calls do): given the process's CPU over the same window,
what no snapshot holds is the role ``ENDED``. A thread is
known by its id and its start time, not its name: trio's cached worker threads take each job's name
while they run it, and a renamed thread counted from zero would charge a window with its whole life.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_TASKS = Path("/proc/self/task")
ENDED = "ended"  # split()'s role for the CPU of threads that ended within the window


@dataclass(frozen=True, slots=True)
class ThreadTime:
    name: str
    cpu_s: float  # user + system
    started: int  # clock ticks since boot: a thread id the kernel gives again is a thread that started later


def snapshot() -> dict[int, ThreadTime]:
    """Every thread of this process now: its id → name and CPU seconds (empty off Linux)."""
    if not _TASKS.is_dir():
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    python_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    threads: dict[int, ThreadTime] = {}
    for entry in _TASKS.iterdir():
        try:
            stat = (entry / "stat").read_text()
            kernel_name = (entry / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        tid = int(entry.name)
        # The command name may hold spaces and parentheses: the fields after it start past the last ")".
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        started = int(fields[19])  # starttime (field 22)
        threads[tid] = ThreadTime(python_names.get(tid, kernel_name), ticks / tick, started)
    return threads


def split(
    before: Mapping[int, ThreadTime],
    after: Mapping[int, ThreadTime],
    roles: Sequence[tuple[str, str]],
    *,
    process_s: float,
) -> dict[str, float]:
    """CPU seconds per role between two snapshots. ``roles``: (role, thread-name prefix) pairs, the
    first match wins; threads matching none are "other". ``process_s``: the process's CPU over the
    same window (``time.process_time``); what the threads seen do not account for is ``ENDED``. Every
    role appears, 0.0 when idle; none off Linux (``after`` empty)."""
    if not after:  # off Linux: no split
        return {}
    seconds = dict.fromkeys([role for role, _ in roles] + ["other"], 0.0)
    for tid, now in after.items():
        earlier = before.get(tid)
        used = now.cpu_s - (earlier.cpu_s if earlier is not None and earlier.started == now.started else 0.0)
        role = next((r for r, prefix in roles if now.name.startswith(prefix)), "other")
        seconds[role] += max(0.0, used)
    # The kernel counts each thread's time in clock ticks: a few ticks' rounding may put the sum above.
    seconds[ENDED] = max(0.0, process_s - sum(seconds.values()))
    return seconds
