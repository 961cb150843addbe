"""Where a missed target's time goes: cProfile over a window of the same work, top functions by own time.

py-spy and pyinstrument are not dependencies; cProfile is in the standard library. It sees
only the thread that enables it (the trio thread, where the router's CPU goes); time in
gRPC's C threads does not show, and time the thread sleeps in epoll shows as ``poll``.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import sysconfig
from pathlib import PurePath
from types import TracebackType

import router
from kvroute_sim.bench.results import ProfileRow

TOP_FUNCTIONS = 12
# Paths are shown from their import root (trio/_core/_run.py, router/keys.py, contextlib.py): the
# longest of these directories a file lies under is cut off.
_ROOTS = sorted(
    {
        os.path.abspath(path)
        for path in (
            *sys.path,
            sysconfig.get_paths()["stdlib"],
            sysconfig.get_paths()["purelib"],
            str(PurePath(router.__file__).parent.parent),
        )
        if path
    },
    key=len,
    reverse=True,
)


def _name(file: str, line: int, function: str) -> str:
    if file == "~":  # a builtin
        return function
    for root in _ROOTS:
        if file.startswith(root + os.sep):
            file = file[len(root) + 1 :]
            break
    return f"{file}:{line}({function})"


class WindowProfile:
    """``with profile:`` around the measured window (on the trio thread); then ``top()`` and ``share()``."""

    def __init__(self) -> None:
        self._profiler = cProfile.Profile()
        self._stats: dict[tuple[str, int, str], tuple[int, int, float, float, object]] | None = None

    def __enter__(self) -> WindowProfile:
        self._profiler.enable()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._profiler.disable()
        # pstats keeps {(file, line, function): (primitive calls, calls, own s, cumulative s, callers)}.
        self._stats = pstats.Stats(self._profiler).stats  # type: ignore[attr-defined]

    def _entries(self) -> dict[tuple[str, int, str], tuple[int, int, float, float, object]]:
        if self._stats is None:
            raise RuntimeError("profile window not closed yet")
        return self._stats

    def top(self, n: int = TOP_FUNCTIONS) -> tuple[ProfileRow, ...]:
        ranked = sorted(self._entries().items(), key=lambda item: item[1][2], reverse=True)
        return tuple(ProfileRow(_name(*key), calls, own, cum) for key, (_, calls, own, cum, _) in ranked[:n])

    def busy_s(self) -> float:
        """Own time of every function except the event loop's idle wait (epoll)."""
        return sum(own for (_, _, fn), (_, _, own, _, _) in self._entries().items() if "poll" not in fn)

    def cumulative_s(self, file_suffix: str, function: str) -> float:
        """Cumulative time of one function (every resumption, for a coroutine)."""
        return sum(
            cum
            for (file, _, fn), (_, _, _, cum, _) in self._entries().items()
            if fn == function and file.endswith(file_suffix)
        )
