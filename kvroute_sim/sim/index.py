"""SimKvcmIndex: the simulated KVCM's prefix index (pure: no I/O, no clock, not thread-safe).

Each registered worker (identity ``ip:http_port``, the ``HostCacheMatch.host_ip_port``)
stores block keys in an LRU of fixed capacity (blocks). A query walks the prompt's keys
once per worker that holds its first block (in C, against that worker's own store), so its
cost is the sum of the reported local matches (plus P2P extensions), not workers × keys: a
10,000-block prompt against 1,000 workers touches only the workers that hold block 0.

P2P, as the real KVCM scores it: the top ``p2p_host_count`` hosts by ``local`` (ties by host string)
are evaluated. For such a host, block ``local`` is its first miss; a peer that holds it
can supply it, and the contiguous prefix extends while each next block is held by the
host or by that same single peer. ``p2p_1_total_match`` is the longest such prefix over
all peers and ``p2p_1_fetch`` the host's misses inside it (fetched from that one peer).
Other hosts get ``p2p_1_fetch = 0`` and ``p2p_1_total_match = local``.

``version`` changes whenever some worker's stored set does, so a caller may keep an answer while it
stays the same (``SimKvcmCluster`` keeps its serialised replies so).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import takewhile

from router.types import HostMatch

_NOBODY: frozenset[str] = frozenset()


class SimKvcmIndex:
    """Block keys stored per worker, each worker an LRU of ``capacity_blocks``."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block key → workers storing it
        self._stored: dict[str, OrderedDict[int, None]] = {}  # worker → its keys, least recent first
        # worker → the same keys as a set: a query's prefix check is then one ``issuperset`` in C
        self._members: dict[str, set[int]] = {}
        self._capacity: dict[str, int] = {}
        self._version = 0  # bumped whenever some worker's stored set changes

    # ---- workers ----

    def add_worker(self, host: str, capacity_blocks: int) -> None:
        """Register ``host`` (``ip:http_port``) with an empty cache; re-adding changes its capacity."""
        if not host.strip():
            raise ValueError("host: blank worker identity")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks: must be >= 1 for {host!r}, got {capacity_blocks}")
        self._stored.setdefault(host, OrderedDict())
        self._members.setdefault(host, set())
        self._capacity[host] = capacity_blocks
        self._evict_over_capacity(host)

    def remove_worker(self, host: str) -> None:
        """Forget ``host`` and everything it stored."""
        self.clear_worker(host)
        del self._stored[host]
        del self._members[host]
        del self._capacity[host]

    def clear_worker(self, host: str) -> None:
        """Drop every block ``host`` stores (a restarted engine has a cold cache)."""
        stored = self._require(host)
        if stored:
            self._version += 1
        for key in stored:
            self._drop_holder(key, host)
        stored.clear()
        self._members[host].clear()

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._stored)

    @property
    def version(self) -> int:
        """Changes whenever some worker's stored set does (so a query's answer may have)."""
        return self._version

    def stored_blocks(self, host: str) -> int:
        return len(self._require(host))

    def holds(self, host: str, key: int) -> bool:
        return key in self._require(host)

    # ---- updates ----

    def record_prefill(self, host: str, keys: Iterable[int]) -> int:
        """Store a prompt's block keys at ``host`` after a prefill ran there; returns blocks evicted.

        Keys are touched last-to-first, so the prompt's first block ends most recently used:
        under pressure a prompt's tail is evicted before its prefix (as engines free blocks
        tail first), which keeps shared prefixes matchable.
        """
        stored = self._require(host)
        members = self._members[host]
        holders = self._holders
        stored_before = len(stored)
        for key in reversed(list(keys)):
            if key in stored:
                stored.move_to_end(key)  # recency only: no answer changes
            else:
                stored[key] = None
                members.add(key)
                holder_set = holders.get(key)
                if holder_set is None:
                    holders[key] = {host}
                else:
                    holder_set.add(host)
        if len(stored) != stored_before:
            self._version += 1
        return self._evict_over_capacity(host)

    # ---- queries ----

    def local_prefix(self, host: str, keys: Sequence[int]) -> int:
        """Contiguous stored prefix of ``keys`` at ``host`` (the oracle's view of one worker)."""
        self._require(host)
        return _stored_prefix(self._members[host], keys)

    def match(self, keys: Sequence[int], p2p_host_count: int = 0) -> tuple[HostMatch, ...]:
        """Every worker with local > 0, ordered by local desc then host; P2P fields per the module doc.

        ``keys`` may be a wire message's repeated field: it is copied into Python ints once, and only
        when some worker holds its first block (each holder's walk reads that copy)."""
        if not keys:
            return ()
        first = self._holders.get(keys[0])
        if not first:
            return ()
        keys = keys[:]
        local = self._local_matches(keys, first)
        ranked = sorted(local.items(), key=lambda item: (-item[1], item[0]))
        evaluated = ranked[: max(0, p2p_host_count)]
        p2p = {host: self._p2p_extension(host, n, keys) for host, n in evaluated}
        return tuple(
            HostMatch(host, n, *p2p[host]) if host in p2p else HostMatch(host, n, 0, n) for host, n in ranked
        )

    def _local_matches(self, keys: Sequence[int], first: set[str]) -> dict[str, int]:
        """Each holder of block 0 (``first``: only they can match) and its contiguous prefix."""
        members = self._members
        return {host: _stored_prefix(members[host], keys) for host in first}

    def _p2p_extension(self, host: str, local: int, keys: Sequence[int]) -> tuple[int, int]:
        """(p2p_1_fetch, p2p_1_total_match) for ``host`` whose contiguous prefix is ``local``."""
        n = len(keys)
        if local >= n:
            return 0, local
        mine = self._stored[host]
        peers = self._holders.get(keys[local], _NOBODY)  # never ``host``: it misses this block
        if not peers:
            return 0, local
        fetched = 1
        j = local + 1
        while j < n:
            key = keys[j]
            if key not in mine:
                holding = self._holders.get(key, _NOBODY)
                if not peers <= holding:
                    peers = peers & holding
                    if not peers:
                        break
                fetched += 1
            j += 1
        return fetched, j

    # ---- internals ----

    def _require(self, host: str) -> OrderedDict[int, None]:
        stored = self._stored.get(host)
        if stored is None:
            raise ValueError(f"host: unknown worker {host!r} (add_worker first)")
        return stored

    def _evict_over_capacity(self, host: str) -> int:
        stored = self._stored[host]
        members = self._members[host]
        capacity = self._capacity[host]
        evicted = 0
        while len(stored) > capacity:
            key, _ = stored.popitem(last=False)
            members.discard(key)
            self._drop_holder(key, host)
            evicted += 1
        if evicted:
            self._version += 1
        return evicted

    def _drop_holder(self, key: int, host: str) -> None:
        holder_set = self._holders[key]
        holder_set.discard(host)
        if not holder_set:
            del self._holders[key]


def _stored_prefix(members: set[int], keys: Sequence[int]) -> int:
    """How many of ``keys``, from the first, ``members`` holds without a gap. A whole prompt held (the
    common answer) is one ``issuperset``, which looks each key up in C and stops at the first miss;
    otherwise ``takewhile`` over ``__contains__`` (also in C, no Python per key) finds where."""
    if members.issuperset(keys):
        return len(keys)
    return len(list(takewhile(members.__contains__, keys)))
