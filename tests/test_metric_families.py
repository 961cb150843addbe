"""The sink's own counters and histograms expose what prometheus-client's would.

Each test applies the same operations to a family of ours and to prometheus-client's metric of
the same kind, each in its own registry, and compares the two expositions (text and OpenMetrics)
with prometheus-client's ``_created`` samples left out (ours keep no creation time)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from actors.metric_families import OwnedCounter, OwnedFamilies, OwnedHistogram
from actors.metrics_sink import DURATION_BUCKETS

LABELS = ("a", "b", "c")
# The OpenMetrics writer is left untyped by the library.
generate_openmetrics = cast(Callable[[CollectorRegistry], bytes], openmetrics.generate_latest)


def _without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


def _same_exposition(ours: OwnedFamilies, theirs: CollectorRegistry) -> None:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ours)
    assert _without_created(generate_latest(registry)) == _without_created(generate_latest(theirs))
    assert _without_created(generate_openmetrics(registry)) == _without_created(generate_openmetrics(theirs))


values = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(st.lists(st.tuples(st.sampled_from(LABELS), values), max_size=40))
def test_a_labelled_histogram_exposes_what_prometheus_clients_would(observations: list[tuple[str, float]]) -> None:
    families, theirs = OwnedFamilies(), CollectorRegistry()
    ours = OwnedHistogram("h_seconds", "help", ("stage",), buckets=DURATION_BUCKETS, families=families)
    reference = Histogram("h_seconds", "help", ("stage",), buckets=DURATION_BUCKETS, registry=theirs)
    for label, value in observations:
        ours.labels(label).observe(value)
        reference.labels(stage=label).observe(value)
    _same_exposition(families, theirs)


@given(st.lists(st.sampled_from((0.0, 15.0, 16.0, 16.5, 64.0, 65536.0, 1e9, 3.0)), max_size=30))
def test_an_unlabelled_histogram_counts_a_value_on_a_bound_in_that_bound_s_bucket(observations: list[float]) -> None:
    buckets = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
    families, theirs = OwnedFamilies(), CollectorRegistry()
    ours = OwnedHistogram("tokens", "help", buckets=buckets, families=families)
    reference = Histogram("tokens", "help", buckets=buckets, registry=theirs)
    for value in observations:
        ours.observe(value)
        reference.observe(value)
    _same_exposition(families, theirs)


@given(st.lists(st.tuples(st.sampled_from(LABELS), st.sampled_from(LABELS), st.integers(0, 5)), max_size=40))
def test_counters_expose_what_prometheus_clients_would(increments: list[tuple[str, str, int]]) -> None:
    families, theirs = OwnedFamilies(), CollectorRegistry()
    ours = OwnedCounter("decisions", "help", ("source", "reason"), families=families)
    plain = OwnedCounter("dropped", "help", families=families)
    reference = Counter("decisions", "help", ("source", "reason"), registry=theirs)
    plain_reference = Counter("dropped", "help", registry=theirs)
    for source, reason, n in increments:
        ours.labels(source, reason).inc(n)
        reference.labels(source=source, reason=reason).inc(n)
        plain.inc()
        plain_reference.inc()
    _same_exposition(families, theirs)


def test_a_sample_is_read_by_its_name_and_labels() -> None:
    families = OwnedFamilies()
    histogram = OwnedHistogram("d_seconds", "help", ("stage",), buckets=(0.1, 1.0), families=families)
    counter = OwnedCounter("c", "help", ("kind",), families=families)
    histogram.labels("total").observe(0.5)
    histogram.labels("total").observe(5.0)
    counter.labels("refresh").inc(3)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(families)
    assert registry.get_sample_value("d_seconds_bucket", {"stage": "total", "le": "0.1"}) == 0.0
    assert registry.get_sample_value("d_seconds_bucket", {"stage": "total", "le": "1.0"}) == 1.0
    assert registry.get_sample_value("d_seconds_bucket", {"stage": "total", "le": "+Inf"}) == 2.0
    assert registry.get_sample_value("d_seconds_count", {"stage": "total"}) == 2.0
    assert registry.get_sample_value("d_seconds_sum", {"stage": "total"}) == 5.5
    assert registry.get_sample_value("c_total", {"kind": "refresh"}) == 3.0


def test_misuse_is_refused_naming_the_metric() -> None:
    families = OwnedFamilies()
    labelled = OwnedCounter("labelled", "help", ("kind",), families=families)
    with pytest.raises(ValueError, match="labelled: labelled by"):
        labelled.inc()
    with pytest.raises(ValueError, match="labelled: labels"):
        labelled.labels("a", "b")
    with pytest.raises(ValueError, match="labelled registered twice"):
        OwnedCounter("labelled", "help", families=families)
    with pytest.raises(ValueError, match="h: buckets must be strictly ascending"):
        OwnedHistogram("h", "help", buckets=(1.0, 0.5), families=families)
    explicit_inf = OwnedHistogram("inf", "help", buckets=(1.0, math.inf), families=families)
    explicit_inf.observe(2.0)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(families)
    assert registry.get_sample_value("inf_bucket", {"le": "+Inf"}) == 1.0
