"""Reading a gateway's ``/metrics`` text from outside, as the benchmark and the tests do: a counter summed over
its series, its checks of its predictions, what keep-warm spent per pod, and histograms' buckets and quantiles."""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families


def sample_sum(metrics_text: str, name: str, **labels: str) -> float:
    """The samples named ``name`` (``gateway_requests_total``) whose labels include ``labels``, summed."""
    return sum(sample.value for family in text_string_to_metric_families(metrics_text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def prediction_checks(metrics_text: str) -> dict[str, float]:
    """From a gateway's ``/metrics`` text: its checks of its predictions against the engines, summed by
    outcome (``prediction_<outcome>``), ``drift``, the highest drift gauge (present once a model has a
    drift gauge), and the prompt tokens its placement lost by cause (``lost_<cause>``)."""
    checks: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "gateway_kv_prediction_exact_total":
                key = "prediction_" + sample.labels["outcome"]
                checks[key] = checks.get(key, 0.0) + sample.value
            elif sample.name == "gateway_placement_lost_tokens_total":
                key = "lost_" + sample.labels["cause"]
                checks[key] = checks.get(key, 0.0) + sample.value
            elif sample.name == "gateway_kv_drift":
                checks["drift"] = max(checks.get("drift", 0.0), sample.value)
            elif sample.name == "gateway_keep_warm_returns_total":
                key = "keep_warm_" + sample.labels["outcome"]
                checks[key] = checks.get(key, 0.0) + sample.value
            elif sample.name == "gateway_keep_warm_requests_total" and sample.labels["outcome"] == "cancelled":
                checks["keep_warm_cancelled"] = checks.get("keep_warm_cancelled", 0.0) + sample.value
    return checks


class KeepWarmSpent(NamedTuple):
    """What a pod spent on keep-warm refreshes, as its own counters see them: the refreshes it finished
    (its finished-requests counter includes them), those it aborted when they gave way to a client (that
    counter does not: vLLM counts no aborted request), and the prompt tokens of both (those found cached
    among them), which its prefix-cache counters include."""

    requests: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    cancelled: float = 0.0


def keep_warm_spent(metrics_text: str) -> dict[str, KeepWarmSpent]:
    """From a gateway's ``/metrics`` text: per pod, what its keep-warm refreshes spent (:class:`KeepWarmSpent`)."""
    slot = {"ok": 0, "cancelled": 3}
    spent: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "gateway_keep_warm_requests_total" and sample.labels["outcome"] in slot:
                spent.setdefault(sample.labels["pod"], [0.0] * 4)[slot[sample.labels["outcome"]]] += sample.value
            elif sample.name == "gateway_keep_warm_tokens_total":
                i = 1 if sample.labels["kind"] == "prompt" else 2
                spent.setdefault(sample.labels["pod"], [0.0] * 4)[i] += sample.value
    return {pod: KeepWarmSpent(*values) for pod, values in spent.items()}


# Cumulative bucket counts of one histogram, by upper bound (``inf`` last).
Buckets = dict[float, float]


def histogram_buckets(metrics_text: str, name: str, label: str | None = None) -> dict[str, Buckets]:
    """From ``/metrics`` text: histogram ``name``'s cumulative bucket counts per value of ``label`` ("" when
    none is named), summed over its other labels."""
    out: dict[str, Buckets] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                buckets = out.setdefault(sample.labels.get(label, "") if label else "", {})
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return out


def buckets_since(after: Buckets, before: Buckets) -> Buckets:
    """What was observed between two readings of one histogram's buckets."""
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def bucket_quantile(buckets: Buckets, q: float) -> float | None:
    """The ``q`` quantile of a histogram as Prometheus' ``histogram_quantile`` estimates it: linear within the
    bucket it falls in (from 0 for the first); in the ``+Inf`` bucket, the highest finite bound. None when
    nothing was observed."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank and count > below:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
