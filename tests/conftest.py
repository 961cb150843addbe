"""Settings and fixtures shared by the test modules."""

import logging
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import trio
from hypothesis import settings

from actors.channel_pool import ChannelPool
from router.config import ChannelPoolConfig

# Property tests on a shared, busy CI machine: no per-example time limit (a slow example is the
# machine, not the code), and the same examples on every run (derandomized, no example database),
# so a failure reproduces from the test's name alone.
settings.register_profile("kvroute", deadline=None, derandomize=True, database=None)
settings.load_profile("kvroute")


@pytest.fixture
async def pool(nursery: trio.Nursery) -> AsyncIterator[ChannelPool[grpc.Channel]]:
    """A running channel pool of real gRPC channels, closed after the test."""
    channels = ChannelPool(ChannelPoolConfig())
    await nursery.start(channels.run)
    yield channels
    await channels.aclose()


@pytest.fixture
def restore_root_logging() -> Iterator[None]:
    """Logging set-up (setup_logging, serve_cli.run) replaces the root logger's handlers and level:
    put them back as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
