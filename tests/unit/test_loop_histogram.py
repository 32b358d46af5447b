"""The cheap observations of the request path: LoopHistogram exports what prometheus_client's Histogram exports
for the same observations; Children keeps a family's children by their label values."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.loop_histogram import LoopHistogram
from gateway.metrics import Children

BOUNDS = (0.001, 0.002, 0.005, 0.01)


def test_it_exports_the_buckets_count_and_sum_prometheus_client_would():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("t_seconds", "a timing", ["kind", "plugin"], BOUNDS, ours)
    reference = Histogram("t_seconds", "a timing", ["kind", "plugin"], buckets=BOUNDS, registry=theirs)
    rng = random.Random(7)
    # On each bound exactly (Prometheus' le: into that bucket), between them, and past the last.
    amounts = [*BOUNDS, 0.0, 0.0015, 0.02, *(rng.uniform(0, 0.012) for _ in range(500))]
    for i, amount in enumerate(amounts):
        labels = ("scorer", "prefix") if i % 3 else ("picker", "cache_aware")
        loop.labels(*labels).observe(amount)
        reference.labels(*labels).observe(amount)
    for labels in ({"kind": "scorer", "plugin": "prefix"}, {"kind": "picker", "plugin": "cache_aware"}):
        for bound in ("0.001", "0.002", "0.005", "0.01", "+Inf"):
            assert ours.get_sample_value("t_seconds_bucket", {**labels, "le": bound}) == \
                theirs.get_sample_value("t_seconds_bucket", {**labels, "le": bound})
        assert ours.get_sample_value("t_seconds_count", labels) == theirs.get_sample_value("t_seconds_count", labels)
        assert ours.get_sample_value("t_seconds_sum", labels) == pytest.approx(
            theirs.get_sample_value("t_seconds_sum", labels))
    text = generate_latest(ours).decode()
    assert '# TYPE t_seconds histogram' in text
    assert 't_seconds_bucket{kind="picker",le="+Inf",plugin="cache_aware"}' in text


def test_a_child_is_asked_for_with_every_label():
    loop = LoopHistogram("t_seconds", "a timing", ["step"], BOUNDS, CollectorRegistry())
    assert loop.labels("route") is loop.labels("route")
    with pytest.raises(ValueError, match="takes labels"):
        loop.labels("route", "extra")


def test_its_name_is_taken_in_the_registry_like_any_family():
    registry = CollectorRegistry()
    LoopHistogram("t_seconds", "a timing", ["step"], BOUNDS, registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Histogram("t_seconds", "again", ["step"], buckets=BOUNDS, registry=registry)


def test_children_looks_each_label_set_up_once_and_counts_into_the_family():
    registry = CollectorRegistry()
    family = Counter("t_total", "a count", ["model", "mode"], registry=registry)
    children = Children(family)
    assert children("m", "local") is children("m", "local") is family.labels("m", "local")
    children("m", "local").inc()
    children("m", "remote").inc(2)
    assert registry.get_sample_value("t_total", {"model": "m", "mode": "local"}) == 1
    assert registry.get_sample_value("t_total", {"model": "m", "mode": "remote"}) == 2
