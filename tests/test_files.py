"""A file an operator names is refused, not waited on, when it is a FIFO: open() on one blocks until a
writer comes, with no time limit (--config, --debug-token-file, --tokens-file, TLS files, replay and
the decision log's path all hung so)."""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from router.decision_record import LogFormatError, read_frames, unusable_log_path
from router.files import NotARegularFile, open_regular_file
from router.route_cli import InputError, request_from_args
from router.settings import load_config

T = TypeVar("T")
GUARD_S = 30  # far beyond a refusal; a read waiting on the FIFO would wait for ever


def returns(call: Callable[[], T], fifo: Path) -> T | BaseException:
    """What ``call`` returned or raised, run in a thread so that a call waiting on the FIFO fails the
    test instead of hanging it (then a writer is opened and closed to let it go)."""
    outcome: list[T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer's end: the blocked open returns
        thread.join(GUARD_S)
        pytest.fail(f"still waiting on the FIFO {fifo} after {GUARD_S} s")
    return outcome[0]


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_open_regular_file_refuses_a_fifo_and_a_directory_and_reads_a_file(fifo: Path, tmp_path: Path) -> None:
    refused = returns(lambda: open_regular_file(str(fifo)), fifo)
    assert isinstance(refused, NotARegularFile) and isinstance(refused, OSError)
    assert refused.strerror == "not a regular file (a named pipe)"
    with pytest.raises(NotARegularFile, match=r"not a regular file \(a directory\)"):
        open_regular_file(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        open_regular_file(str(tmp_path / "missing"))
    text = tmp_path / "text"
    text.write_bytes(b"1 2 3\n")
    with open_regular_file(str(text)) as file:
        assert file.read() == b"1 2 3\n"


def test_settings_files_that_are_fifos_are_problems_naming_the_flag(fifo: Path, tmp_path: Path) -> None:
    loaded = returns(lambda: load_config({}, {}, str(fifo)), fifo)
    assert not isinstance(loaded, BaseException)
    assert [str(p) for p in loaded.fatal_errors if p.settings == ()] == [
        f"--config {fifo}: cannot read the file: not a regular file (a named pipe)"
    ]
    token = returns(lambda: load_config({"debug_token_file": str(fifo)}, {}), fifo)
    assert not isinstance(token, BaseException)
    assert any(
        str(p).startswith("--debug-token-file") and "not a regular file (a named pipe)" in str(p)
        for p in token.fatal_errors
    ), token.fatal_errors
    tls = returns(lambda: load_config({"grpc_tls_cert": str(fifo), "grpc_tls_key": str(fifo)}, {}), fifo)
    assert not isinstance(tls, BaseException)
    named = [str(p) for p in tls.fatal_errors if "not a regular file (a named pipe)" in str(p)]
    assert any(p.startswith("--grpc-tls-cert") for p in named) and any("--grpc-tls-key" in p for p in named), named


def test_a_tokens_file_that_is_a_fifo_is_refused_naming_the_flag(fifo: Path) -> None:
    refused = returns(lambda: request_from_args(argparse.Namespace(tokens=None, tokens_file=str(fifo))), fifo)
    assert isinstance(refused, InputError)
    assert str(refused) == f"--tokens-file: cannot read {fifo}: not a regular file (a named pipe)"


def test_a_decision_log_path_that_is_a_fifo_is_refused_by_replay_and_by_the_log(fifo: Path) -> None:
    refused = returns(lambda: list(read_frames(str(fifo))), fifo)
    assert isinstance(refused, LogFormatError)
    assert str(refused) == f"{fifo}: byte offset 0: cannot read the file: not a regular file (a named pipe)"
    # The log's path: neither rotated away nor opened (the writer's open would wait for a reader).
    assert returns(lambda: unusable_log_path(str(fifo)), fifo) == "is not a regular file (a named pipe)"
