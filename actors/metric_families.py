"""Counters and histograms the MetricsSink's task alone changes, exposed through a registry.

prometheus-client's own metrics take a lock on every increment and observation, so that threads
may share them; a routed decision makes about thirty of those, each several times the cost of the
addition it guards. The sink's metrics have one writer, the sink's task (but for the count of
events dropped at a full inbox, which their senders add to), and one reader, the scrape; all run on
the same trio thread, each between the others' steps: plain numbers need no lock.
prometheus-client still does the exposition: each family here yields its ``*MetricFamily`` at
collection time, with the names, label order and bucket bounds (``le``) its metric classes give.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar, cast

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# A bucket bound as prometheus-client writes it in ``le`` (0.25, 1.0, +Inf); the library leaves it untyped.
_le_text = cast(Callable[[float], str], floatToGoString)


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds  # ascending, +inf last
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # The first bound at or above the value: a bucket counts what is at most its bound (le).
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value


Child = TypeVar("Child", CounterChild, HistogramChild)


class _Family(Generic[Child]):
    """Children by label values, in the family's label order; an unlabelled family has one child."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, families: OwnedFamilies
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()
        families.add(self)

    def _new_child(self) -> Child:
        raise NotImplementedError

    def labels(self, *values: str) -> Child:
        """The child for ``values`` (the family's labels, in order), made on first use."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames} take as many values, got {values}")
            child = self._children[values] = self._new_child()
        return child

    def _only(self) -> Child:
        if self.labelnames:
            raise ValueError(f"{self.name}: labelled by {self.labelnames}; use labels()")
        return self._children[()]

    def children(self) -> Iterator[tuple[tuple[str, ...], Child]]:
        yield from self._children.items()

    def collect(self) -> Metric:
        raise NotImplementedError


class OwnedCounter(_Family[CounterChild]):
    """Exposed as ``<name>_total``, as prometheus-client's Counter (without its ``_created``)."""

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children():
            family.add_metric(values, child.value)
        return family


class OwnedHistogram(_Family[HistogramChild]):
    """``buckets``: the upper bounds, ascending (``+Inf`` is added, as prometheus-client adds it)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        families: OwnedFamilies,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must be strictly ascending, got {buckets}")
        self._bounds = bounds if bounds and bounds[-1] == math.inf else (*bounds, math.inf)
        super().__init__(name, documentation, labelnames, families=families)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def observe(self, value: float) -> None:
        self._only().observe(value)

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [_le_text(b) for b in self._bounds]
        for values, child in self.children():
            cumulative, buckets = 0, []
            for le, count in zip(les, child.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(values, buckets, child.sum)
        return family


class OwnedFamilies(Collector):
    """The families made with it (``families=``); a scrape collects them in that order. Register it
    with a registry once its families are made (an auto-describing registry reads their names then)."""

    def __init__(self) -> None:
        self._families: list[_Family[CounterChild] | _Family[HistogramChild]] = []
        self._names: set[str] = set()

    def add(self, family: _Family[CounterChild] | _Family[HistogramChild]) -> None:
        if family.name in self._names:
            raise ValueError(f"metric {family.name} registered twice")
        self._names.add(family.name)
        self._families.append(family)

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.collect()
