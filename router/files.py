"""Opening a file an operator names (a settings, token, tokens or log file) for reading.

A FIFO at such a path blocks ``open()`` until a writer comes, with no time limit, and a device may
never end a read: the file is opened without blocking and refused before any read unless it is a
regular file.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
    """What an ``st_mode`` that is no regular file's names: "a named pipe" and the like."""
    return next((name for test, name in _KINDS if test(mode)), "not a file")


class NotARegularFile(OSError):
    """The path names something other than a regular file; ``strerror`` says what."""


def open_regular_file(path: str) -> BinaryIO:
    """``path`` opened for binary reading. Raises OSError as ``open()`` does, and NotARegularFile
    (an OSError, ``strerror`` "not a regular file (a named pipe)" and the like) without waiting on a
    FIFO or reading a device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(errno.EINVAL, f"not a regular file ({kind_of(mode)})", path)
        return open(fd, "rb")  # O_NONBLOCK changes nothing on a regular file
    except BaseException:
        os.close(fd)
        raise
