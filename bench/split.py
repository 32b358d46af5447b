"""Where each request's time to first token went: the client's TTFT joined, by the ``x-request-id`` it sent,
with the gateway's access record of it and the pod's own account of it.

Owner: nothing with a lifetime: rows and their percentiles, from what a run left behind.

Per request (``gateway bench --split``): the client's TTFT; the gateway's steps before it dispatched the
request (parse, tokenize, prepare, admit, route, dispatch: the time it waited inside the gateway) and from
dispatch to the pod's first byte (connect, first_byte); the chosen pod's requests in flight (this gateway's
ledger) at dispatch; the pod's own time in its waiting queue (vLLM's ``request_queue_time_seconds``) and its
TTFT. Load on a shared machine moves every time; the queue time a placement causes and the in-flight count
of the pod it chose are the pod's and the router's own, which load does not explain.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from pathlib import Path

import orjson

# The gateway's steps before the call leaves for the pod, and after (gateway.request.timings).
BEFORE_DISPATCH = ("parse", "tokenize", "prepare", "admit", "route", "dispatch")
AFTER_DISPATCH = ("connect", "first_byte")
COLUMNS = ("request_id", "session", "step", "pod", "reason", "client_ttft_ms", "gateway_ms", "to_first_byte_ms",
           "pod_in_flight", "pod_queue_ms", "pod_ttft_ms", "rest_ms", *(f"{s}_ms" for s in BEFORE_DISPATCH))


def access_records(lines: Iterable[bytes]) -> dict[str, dict]:
    """The gateway's JSON access records (``logging.json``), by request id; other lines are skipped."""
    out: dict[str, dict] = {}
    for line in lines:
        if not line.startswith(b"{"):
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if record.get("logger") == "gateway.access" and "request_id" in record:
            out[record["request_id"]] = record
    return out


def rows(requests: Iterable[tuple[str, int, int, float]], access: dict[str, dict],
         pod_ttft_s: dict[str, float], pod_queue_s: dict[str, float]) -> list[dict[str, float | str | None]]:
    """One row per answered request ``(request id, session, step, client TTFT s)``: what is known of it
    (None where nobody said: no gateway in front, a router that did not pass the id on)."""
    out = []
    for request_id, session, step, ttft_s in requests:
        record = access.get(request_id, {})
        steps = record.get("steps_ms") or {}
        before = [steps[s] for s in BEFORE_DISPATCH if s in steps]
        after = [steps[s] for s in AFTER_DISPATCH if s in steps]
        pod_ttft = pod_ttft_s.get(request_id)
        row: dict[str, float | str | None] = {
            "request_id": request_id, "session": session, "step": step, "pod": record.get("pod"),
            "reason": record.get("reason"), "client_ttft_ms": round(ttft_s * 1000, 3),
            "gateway_ms": round(sum(before), 3) if before else None,
            "to_first_byte_ms": round(sum(after), 3) if after else None,
            "pod_in_flight": record.get("pod_in_flight"),
            "pod_queue_ms": round(pod_queue_s[request_id] * 1000, 3) if request_id in pod_queue_s else None,
            "pod_ttft_ms": round(pod_ttft * 1000, 3) if pod_ttft is not None else None,
            # What neither the gateway's steps before dispatch nor the pod's TTFT hold: the hops, the pod's
            # HTTP handling and tokenization, the relay back, the client's own loop.
            "rest_ms": round(ttft_s * 1000 - sum(before) - pod_ttft * 1000, 3)
            if pod_ttft is not None and before else None,
        }
        row.update({f"{s}_ms": steps.get(s) for s in BEFORE_DISPATCH})
        out.append(row)
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank: the smallest value with at least ``q`` of them at or below)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary(table: list[dict[str, float | str | None]]) -> dict[str, float]:
    """p50 and p90 of each measured column over the rows that have it (``split_<column>_p50``), the mean
    in-flight count of the chosen pod, and the share of requests sent to a pod with others in flight."""
    out: dict[str, float] = {}
    for column in ("gateway_ms", "to_first_byte_ms", "pod_queue_ms", "pod_ttft_ms", "rest_ms",
                   *(f"{s}_ms" for s in BEFORE_DISPATCH)):
        values = [float(v) for r in table if isinstance(v := r.get(column), (int, float))]
        if values:
            out[f"split_{column}_p50"] = round(percentile(values, 0.5), 3)
            out[f"split_{column}_p90"] = round(percentile(values, 0.9), 3)
    flights = [float(v) for r in table if isinstance(v := r.get("pod_in_flight"), (int, float))]
    if flights:
        out["split_pod_in_flight_mean"] = round(sum(flights) / len(flights), 3)
        out["split_pod_busy_share"] = round(sum(1 for f in flights if f > 0) / len(flights), 4)
    queued = [float(v) for r in table if isinstance(v := r.get("pod_queue_ms"), (int, float))]
    if queued:
        out["split_pod_queue_ms_mean"] = round(sum(queued) / len(queued), 3)
    return out


def write_rows(table: list[dict[str, float | str | None]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)


def split_line(extra: dict[str, float]) -> str:
    """The split as one printed line ("" without one)."""
    parts = []
    for column, label in (("gateway_ms", "in gateway"), ("to_first_byte_ms", "dispatch to first byte"),
                          ("pod_queue_ms", "pod queue"), ("pod_ttft_ms", "pod TTFT"), ("rest_ms", "rest")):
        if f"split_{column}_p50" in extra:
            parts.append(f"{label} p50/p90 {extra[f'split_{column}_p50']:.2f}/{extra[f'split_{column}_p90']:.2f} ms")
    if "split_pod_in_flight_mean" in extra:
        parts.append(f"chosen pod's in flight mean {extra['split_pod_in_flight_mean']:.2f} "
                     f"(busy {extra['split_pod_busy_share']:.0%})")
    return "; ".join(parts)
