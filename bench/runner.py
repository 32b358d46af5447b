"""Replays one trace through each contender, each on fresh simulated pods (or on the user's own pods).

Owner: a :class:`BenchRunner` owns the processes it starts (pods, routers) and stops them all, by pid,
whatever happens. Cache hits are read from the pods' own prefix-cache counters, latency on the client.
Beside each measured hit ratio it puts the trace's references (:mod:`bench.oracle`), computed
from the answers that run recorded, for the pods' block size and capacity as their metrics say them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple

import aiohttp
import msgspec
import orjson
from tqdm import tqdm

from bench.metrics_text import (
    Buckets,
    KeepWarmSpent,
    bucket_quantile,
    buckets_since,
    histogram_buckets,
    keep_warm_spent,
    prediction_checks,
)
from bench.oracle import ChatEncoder, Oracle, trace_oracle
from bench.peers import PEERS, PeerBinary, install_peer, resolve_peer
from bench.split import access_records, write_rows
from bench.split import rows as split_rows
from bench.split import summary as split_summary
from bench.tenants import tenant_stats
from bench.workloads import History, Session, Trace
from gateway.config import PodConfig
from gateway.epp.envoy_config import bootstrap_yaml
from gateway.pods.scraper import parse_engine_metrics
from gateway.request.timings import STEP_NAMES
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from simulator.config import MockPodsConfig
from simulator.engine import MODEL_MAX_LEN
from simulator.launcher import MockPodFleet
from simulator.pod import free_port

Kind = Literal["direct", "gateway", "envoy-epp", "vllm-router", "sglang-router", "smg"]


class Contender(msgspec.Struct, frozen=True):
    name: str
    kind: Kind  # a peer's kind is its package's key in bench.peers.PEERS
    policy: str = "round_robin"
    env: dict[str, str] = {}
    # Gateway replicas, each with its own index; the client spreads requests over them round-robin,
    # as a Kubernetes Service would. They share workflow state through a Redis the runner starts, unless
    # ``share_state`` is off; ``redis_lost_at``: the share of the trace's requests after which it stops.
    replicas: int = 1
    share_state: bool = True
    redis_lost_at: float | None = None
    workers: int = 1  # per gateway replica (serve --workers)
    # Prefill/decode disaggregation: this many of the simulated pods take the prefill leg, the others
    # decode, their KV passed over NIXL (the connector every P/D router here speaks).
    prefill_pods: int = 0
    # A trace's LoRA adapters: none registered on the pods at start, the gateway registers each where it
    # is needed (else every pod registers every adapter at start, as peers need).
    lora_on_demand: bool = False
    # How the simulated pods order their waiting requests (vLLM's --scheduling-policy); the gateway is told.
    scheduling: Literal["fcfs", "priority"] = "fcfs"


CONTENDERS = {
    c.name: c for c in [
        Contender("direct", "direct", "round_robin"),
        Contender("gateway-round_robin", "gateway", "round_robin"),
        Contender("gateway-least_request", "gateway", "least_request"),
        Contender("gateway-prefix_cache", "gateway", "prefix_cache"),
        Contender("gateway-kv_aware", "gateway", "kv_aware"),
        Contender("gateway-kv_aware-no-workflow", "gateway", "kv_aware", {"GATEWAY_WORKFLOW__ENABLED": "false"}),
        Contender("gateway-kv_aware-no-keep-warm", "gateway", "kv_aware",
                  {"GATEWAY_WORKFLOW__KEEP_WARM__ENABLED": "false"}),
        # Routed by the prompt's text (the approximate index), no tokenizer: what exact tokenizing costs.
        Contender("gateway-kv_aware-by-text", "gateway", "kv_aware",
                  {"GATEWAY_TOKENIZATION__MODELS": "{}", "GATEWAY_TOKENIZATION__DEFAULT_MODE": "none"}),
        Contender("gateway-kv_aware-no-flow-control", "gateway", "kv_aware",
                  {"GATEWAY_FLOW_CONTROL__ENABLED": "false"}),
        # Pods that serve the lowest request priority first (vLLM --scheduling-policy priority).
        Contender("gateway-kv_aware-priority-pods", "gateway", "kv_aware", scheduling="priority"),
        Contender("gateway-kv_aware-priority-pods-no-flow-control", "gateway", "kv_aware",
                  {"GATEWAY_FLOW_CONTROL__ENABLED": "false"}, scheduling="priority"),
        Contender("gateway-kv_aware-2-replicas", "gateway", "kv_aware", replicas=2),
        Contender("gateway-kv_aware-2-replicas-unshared", "gateway", "kv_aware", replicas=2, share_state=False),
        Contender("gateway-kv_aware-2-replicas-redis-lost", "gateway", "kv_aware", replicas=2, redis_lost_at=0.5),
        Contender("gateway-kv_aware-2-workers", "gateway", "kv_aware", workers=2),
        Contender("gateway-kv_aware-4-workers", "gateway", "kv_aware", workers=4),
        # Every pod looked at for each request (no shortlist): the reference the shortlist's hit ratio is held to.
        Contender("gateway-kv_aware-full-scan", "gateway", "kv_aware", {"GATEWAY_ROUTING__MAX_CANDIDATES": "0"}),
        Contender("gateway-slo", "gateway", "slo"),
        # A real Envoy relaying the bytes, ``gateway epp`` choosing each pod over ext_proc.
        Contender("envoy-epp-kv_aware", "envoy-epp", "kv_aware"),
        Contender("envoy-epp-round_robin", "envoy-epp", "round_robin"),
        Contender("vllm-router-round_robin", "vllm-router", "round_robin"),
        Contender("vllm-router-cache_aware", "vllm-router", "cache_aware"),
        Contender("vllm-router-kv_aware", "vllm-router", "kv_aware"),
        Contender("sglang-router-cache_aware", "sglang-router", "cache_aware"),
        Contender("smg-cache_aware", "smg", "cache_aware"),
        Contender("gateway-kv_aware-lora-on-demand", "gateway", "kv_aware", lora_on_demand=True),
        Contender("gateway-kv_aware-pd", "gateway", "kv_aware", prefill_pods=1),
        Contender("vllm-router-pd-cache_aware", "vllm-router", "cache_aware", prefill_pods=1),
        Contender("vllm-router-pd-round_robin", "vllm-router", "round_robin", prefill_pods=1),
        Contender("smg-pd-cache_aware", "smg", "cache_aware", prefill_pods=1),
    ]
}


class ServedBy(NamedTuple):
    """What served a contender: its package ("kv-gateway": the gateway, its version the checkout's commit),
    the version its binary said of itself (peers with ``--version``), and its first router's command line."""

    package: str | None = None
    version: str | None = None
    reported_version: str | None = None
    command: list[str] = []


NOBODY = ServedBy()  # requests straight to the pods


def prepare_peers(contenders: Iterable[Contender], install: bool) -> dict[str, PeerBinary]:
    """The peer routers these contenders name, each checked to be its package at its pinned version (and
    installed first where missing, if ``install``); PeerMissing or PeerRefused with the reason."""
    kinds = sorted({c.kind for c in contenders} & PEERS.keys())
    return {kind: (install_peer if install else resolve_peer)(PEERS[kind]) for kind in kinds}


@dataclass
class Outcome:
    status: int
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    sent_at: float = 0.0  # monotonic, when it was sent
    cache_action: str = ""  # the gateway's x-gateway-cache-action
    answer: str = ""  # the answer's text (empty when the request failed)
    session: int = 0  # the request's session and step in the trace
    step: int = 0
    # The answer's own usage: prompt tokens, of those found cached (None where it does not say), output tokens.
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    request_id: str = ""  # sent as x-request-id: the pods' own TTFT of it is looked up by it


@dataclass
class Result:
    name: str
    policy: str
    scenario: str
    seed: int
    requests: int = 0
    errors: int = 0
    hit_ratio: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    e2e_p50_ms: float = 0.0
    e2e_p90_ms: float = 0.0
    e2e_p99_ms: float = 0.0
    req_per_s: float = 0.0
    # A session's time from its start to its last answer (a workflow's completion time), median.
    session_p50_ms: float = 0.0
    busy_p50_ms: float = 0.0  # a session's time waiting for its answers (its time less the trace's think times)
    rejected: int = 0
    # Requests each pod finished (its own counter) and the busiest pod's share of them.
    pod_requests: list[int] = field(default_factory=list)
    largest_share: float = 0.0
    # The trace's references (bench.oracle) and how far below the sticky one the hit ratio is
    # (negative: above it); none where they could not be computed (no local tokenizer, no cache size).
    infinite: float | None = None
    sticky_lru: float | None = None
    keep_warm: float | None = None  # the sticky placement with free, clairvoyant refreshes
    distance: float | None = None
    skipped: str | None = None
    extra: dict[str, float] = field(default_factory=dict)
    # What served the row (ServedBy; none: direct).
    package: str | None = None
    version: str | None = None
    reported_version: str | None = None
    command: list[str] = field(default_factory=list)
    # Per tenant (the fairness id its requests named), for traces with tenants (bench.tenants).
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)


def session_times(outcomes: list[Outcome]) -> list[float]:
    """Each session's time in ms from its first request sent to its last answered."""
    spans: dict[int, tuple[float, float]] = {}
    for o in outcomes:
        first, last = spans.get(o.session, (o.sent_at, o.sent_at + o.e2e_s))
        spans[o.session] = (min(first, o.sent_at), max(last, o.sent_at + o.e2e_s))
    return [(last - first) * 1000 for first, last in spans.values()]


def busy_times(outcomes: list[Outcome]) -> list[float]:
    """Each session's time in ms waiting for its answers (its requests' latencies summed): its time less
    the think times the trace put between its steps."""
    busy: dict[int, float] = {}
    for o in outcomes:
        busy[o.session] = busy.get(o.session, 0.0) + o.e2e_s * 1000
    return list(busy.values())


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def wait_http(url: str, timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def wait_tcp(port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Until ``proc`` accepts connections on loopback ``port``; RuntimeError if it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args[0]} did not listen on port {port}")


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM to every process still running, then each given ``timeout_s`` to exit before it is killed."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_redis_server(binary: str, port: int) -> subprocess.Popen[bytes]:
    """A throw-away ``redis-server`` on loopback (no persistence), returned once it accepts connections."""
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_tcp(port, 10, proc)
    except RuntimeError:
        proc.kill()
        raise RuntimeError("redis-server did not start") from None
    return proc


def _workers(pods: list[PodConfig], pd_flag: str, aggregated_flag: str) -> list[str]:
    """A peer router's pods: ``--prefill URL ... --decode URL ...`` in its P/D mode, else all of them."""
    if all(p.role == "both" for p in pods):
        return [aggregated_flag, *[p.url for p in pods]]
    out = [pd_flag]
    for p in pods:
        out += ["--prefill", p.url] if p.role == "prefill" else ["--decode", p.url]
    return out


_LEG_METRICS = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
                "vllm:external_prefix_cache_hits_total": "loaded", "vllm:time_to_first_token_seconds_sum": "ttft_s",
                "vllm:time_to_first_token_seconds_count": "firsts",
                # The simulated pods' own: adapters switched into a batch slot, and read from their path.
                "mock_lora_activations_total": "lora_switches", "mock_lora_loads_total": "lora_loads"}


def _leg_counters(url: str) -> dict[str, float]:
    """A simulated pod's own counters of what its leg did: prompt tokens looked up, found cached, loaded from
    another pod, and its time to first token (sum and count)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(_LEG_METRICS.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _LEG_METRICS:
            out[_LEG_METRICS[name]] += float(line.rsplit(" ", 1)[1])
    return out


def _per_leg(pods: list[PodConfig], before: list[dict[str, float]], after: list[dict[str, float]]
             ) -> dict[str, float]:
    """Hit ratio and mean time to first token of each leg, from its pods' own counters; for the decode
    leg also the share of its prompt tokens loaded from a prefill pod."""
    out: dict[str, float] = {}
    for leg in ("prefill", "decode"):
        rows = [(b, a) for p, b, a in zip(pods, before, after, strict=True)
                if (p.role == "prefill") == (leg == "prefill")]
        total = {k: sum(a[k] - b[k] for b, a in rows) for k in _LEG_METRICS.values()}
        out[f"{leg}_hit_ratio"] = round(total["hits"] / total["queries"], 4) if total["queries"] else 0.0
        out[f"{leg}_ttft_ms"] = round(1000 * total["ttft_s"] / total["firsts"], 2) if total["firsts"] else 0.0
        if leg == "decode":
            out["decode_loaded_share"] = round(total["loaded"] / total["queries"], 4) if total["queries"] else 0.0
    return out


def _adapter_switches(trace: Trace, before: list[dict[str, float]], after: list[dict[str, float]]
                      ) -> dict[str, float]:
    """Per 1,000 requests: the adapters the pods switched into a batch slot and read from their path (their
    own counters), and the bound that knows the future: each adapter the trace names switched in once
    (there are as many batch slots as adapters, or more, in the scenario's fleet)."""
    switched = sum(a["lora_switches"] - b["lora_switches"] for b, a in zip(before, after, strict=True))
    loaded = sum(a["lora_loads"] - b["lora_loads"] for b, a in zip(before, after, strict=True))
    used = len({step.model for session in trace.sessions for step in session.steps if step.model})
    per = 1000 / trace.requests if trace.requests else 0.0
    return {"adapter_switches_per_1k": round(switched * per, 1), "adapter_loads_per_1k": round(loaded * per, 1),
            "adapter_switches_bound_per_1k": round(used * per, 1)}


def gateway_version() -> str:
    """The gateway's checkout as ``git describe`` says it (``-dirty``: with uncommitted changes), else the
    installed package's version."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                              text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    from importlib.metadata import version

    return version("kv-gateway")


def _pod_ttfts(urls: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Each request's time to first token at the pod that answered it, and its time in that pod's waiting
    queue, by request id, where the pods say them (simulated pods' ``/debug/ttft``; real vLLM does not)."""
    ttft: dict[str, float] = {}
    queue: dict[str, float] = {}
    for url in urls:
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            with urllib.request.urlopen(f"{url}/debug/ttft", timeout=10) as resp:
                said = orjson.loads(resp.read())
            ttft.update(said["ttft_s"])
            queue.update(said.get("queue_s") or {})
    return ttft, queue


def _added_ttft_per_request(ok: list[Outcome], pod_ttfts: dict[str, float]) -> dict[str, float]:
    """Percentiles of what the router and the hops added to each request's TTFT: the client's TTFT minus
    the pod's own for the same request, matched by the ``x-request-id`` the client sent (a router that does
    not pass it on leaves nothing matched: then only the mean from the pods' histograms is reported)."""
    added = [1000 * (o.ttft_s - pod_ttfts[o.request_id]) for o in ok if o.request_id in pod_ttfts]
    if not added:
        return {}
    return {"added_ttft_ms_p50": round(pct(added, 0.5), 2), "added_ttft_ms_p90": round(pct(added, 0.9), 2),
            "added_ttft_ms_p99": round(pct(added, 0.99), 2), "added_ttft_matched": round(len(added) / len(ok), 4)}


def _added_ttft(ok: list[Outcome], before: list[dict[str, float]], after: list[dict[str, float]]
                ) -> dict[str, float]:
    """The clients' mean time to first token, the pods' own (their histograms' sum over count) and the
    difference: what the router and the hops add before the first token (``direct``: the hops alone). The
    pods' histograms count keep-warm refreshes too (one-token prompts, mostly cached: they pull the pods'
    mean down a little)."""
    firsts = sum(a["firsts"] - b["firsts"] for b, a in zip(before, after, strict=True))
    if not ok or not firsts:
        return {}
    pod_ms = 1000 * sum(a["ttft_s"] - b["ttft_s"] for b, a in zip(before, after, strict=True)) / firsts
    client_ms = 1000 * sum(o.ttft_s for o in ok) / len(ok)
    return {"client_ttft_ms_mean": round(client_ms, 2), "pod_ttft_ms_mean": round(pod_ms, 2),
            "added_ttft_ms_mean": round(client_ms - pod_ms, 2)}


def _metrics_texts(urls: list[str]) -> list[str]:
    """Each gateway's ``/metrics`` (every worker's, merged by the gateway)."""
    texts = []
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            texts.append(resp.read().decode())
    return texts


def _summed(texts: list[str], name: str, label: str | None = None) -> dict[str, Buckets]:
    """Histogram ``name``'s buckets over every gateway, per value of ``label``."""
    out: dict[str, Buckets] = {}
    for text in texts:
        for key, buckets in histogram_buckets(text, name, label).items():
            into = out.setdefault(key, {})
            for bound, count in buckets.items():
                into[bound] = into.get(bound, 0.0) + count
    return out


def gateway_split(before: list[str], after: list[str]) -> dict[str, float]:
    """The gateway's own account of a run, from its histograms' change over it (their buckets' estimate, in
    ms): its event loop's lag (``loop_lag_ms_p50``, ``_p99``), and the median of each step of its requests
    (``step_<step>_ms_p50``: parse, tokenize, ... connect, first_byte), to split the TTFT it adds."""
    out: dict[str, float] = {}
    lag = buckets_since(_summed(after, "gateway_event_loop_lag_seconds").get("", {}),
                        _summed(before, "gateway_event_loop_lag_seconds").get("", {}))
    for key, q in (("loop_lag_ms_p50", 0.5), ("loop_lag_ms_p99", 0.99)):
        if (seconds := bucket_quantile(lag, q)) is not None:
            out[key] = round(1000 * seconds, 3)
    steps_before = _summed(before, "gateway_request_step_seconds", "step")
    steps_after = _summed(after, "gateway_request_step_seconds", "step")
    for name in STEP_NAMES:
        ran = buckets_since(steps_after.get(name, {}), steps_before.get(name, {}))
        if (seconds := bucket_quantile(ran, 0.5)) is not None:
            out[f"step_{name}_ms_p50"] = round(1000 * seconds, 3)
    return out


def kv_ingest(before: list[str], after: list[str], seconds: float, indexer_cpu_s: float) -> dict[str, float]:
    """The KV block events the gateway applied over a run (``gateway_kv_index_blocks``, stored and removed),
    per second, and, where the host's indexers applied them, per second of their CPU."""
    def applied(texts: list[str]) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for text in texts for line in text.splitlines()
                   if line.startswith(("gateway_kv_index_blocks_total{op=\"blocks_stored\"}",
                                       "gateway_kv_index_blocks_total{op=\"blocks_removed\"}")))

    events = applied(after) - applied(before)
    out = {"kv_block_events_per_s": round(events / seconds, 1)} if seconds > 0 else {}
    if indexer_cpu_s > 0:
        out["indexer_cpu_s"] = round(indexer_cpu_s, 2)
    return out


# What ``gateway serve --workers N`` names its indexer processes (/proc/<pid>/comm).
INDEXER_NAME = "gw-indexer"


def _process_and_children(pid: int) -> Iterator[tuple[Path, list[str]]]:
    """The ``/proc`` directory and ``stat`` fields (after the command) of a process and of its children."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # a process may end while it is read
            own, rest = stat.read_text().split(" ", 1)
            fields = rest.rsplit(")", 1)[1].split()
            ours = int(own) == pid or int(fields[1]) == pid  # fields[1]: the parent's pid
        except (OSError, ValueError, IndexError):
            continue
        if ours and len(fields) > 12:
            yield stat.parent, fields


def process_cpu_s(pid: int, named: str | None = None) -> float:
    """User plus system CPU seconds of a process and its children so far (Linux; 0 once it is gone); only
    those whose name (``/proc/<pid>/comm``) starts with ``named``, when given."""
    return sum((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
               for directory, fields in _process_and_children(pid)
               if named is None or _comm(directory).startswith(named))


def _comm(directory: Path) -> str:
    with contextlib.suppress(OSError):
        return (directory / "comm").read_text().strip()
    return ""


def process_memory_mb(pid: int) -> float:
    """The proportional set size of a process and its children (memory they share, the host's prefix index
    among it, counted once), in MiB (Linux; 0 once it is gone)."""
    total_kb = 0
    for directory, _ in _process_and_children(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in (directory / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
                    break
    return total_kb / 1024


def process_switches(pid: int) -> int:
    """Context switches of a process's threads and its children's so far, voluntary (it waited) and
    involuntary (it was preempted) together: how often it was woken or pushed off a core (Linux; 0 once
    it is gone; a thread that ended no longer counts, a router's threads live as long as it)."""
    total = 0
    for directory, _ in _process_and_children(pid):
        for status in directory.glob("task/*/status"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                for line in status.read_text().splitlines():
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        total += int(line.split()[1])
    return total


def _binary(name: str) -> str:
    return shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)


_CACHE_CONFIG_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class CacheConfig(msgspec.Struct, frozen=True):
    block_size: int
    num_blocks: int


def cache_config(url: str) -> CacheConfig | None:
    """A pod's block size and KV blocks, as its ``vllm:cache_config_info`` says (none: it does not)."""
    with contextlib.suppress(OSError, http.client.HTTPException, ValueError, KeyError):
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            found = _CACHE_CONFIG_INFO.search(resp.read().decode())
        if found:
            labels = dict(_LABEL.findall(found.group(1)))
            return CacheConfig(int(labels["block_size"]), int(labels["num_gpu_blocks"]))
    return None


class BenchRunner:
    def __init__(self, *, pods: int = 4, num_blocks: int = 600, block_size: int = 16, speed: float = 0.2,
                 model: str = "mock-llama", tokenizer: str | None = str(BUNDLED_TOKENIZER_DIR),
                 existing_pods: list[PodConfig] | None = None, progress: bool = True,
                 max_model_len: int | None = None, router_logs: str | None = None,
                 peers: dict[str, PeerBinary] | None = None, max_loras: int = 2, pods_per_process: int = 0,
                 split_dir: str | None = None) -> None:
        self.pods, self.num_blocks, self.block_size, self.speed = pods, num_blocks, block_size, speed
        self.max_loras = max_loras  # a LoRA trace's pods: adapters in one batch
        self._adapters: list[str] = []  # the LoRA adapters of the trace being replayed
        self.pods_per_process = pods_per_process
        self.max_model_len = max_model_len
        self.model = model
        # A local tokenizer directory for the routers that tokenize; none: the gateway asks the pods.
        self.tokenizer = tokenizer
        self.existing_pods = existing_pods
        self.progress = progress
        # A directory for each router's output (<contender>-<n>.log); none: discarded.
        self.router_logs = router_logs
        self._logs_per_contender: Counter[str] = Counter()
        # Where each request's TTFT split goes (bench.split; none: not split): the gateway then writes its
        # JSON access records, to the router logs or to files of its own, read back after the run.
        self.split_dir = split_dir
        self._access_logs: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        # Each peer's checked binary, by kind: as given, else resolved (and checked) when first served.
        self._peers: dict[str, PeerBinary] = dict(peers or {})
        self.served_by = NOBODY  # the contender being served
        self._redis: subprocess.Popen[bytes] | None = None
        self._encoder: ChatEncoder | None = None
        # Every request's x-request-id: unique across runs, so pods kept between contenders never mix them up.
        self._run_id = f"bench-{os.urandom(4).hex()}"
        self._request_ids = itertools.count()
        # The last oracle computed: its trace, pods' cache configs and answers (contenders replaying a trace
        # on the simulated pods get the same answers, so the same references).
        self._last_oracle: tuple[Trace, object, Oracle] | None = None
        # The routers of the contender being served (their CPU is what some benchmarks measure).
        self.router_processes: list[subprocess.Popen[bytes]] = []
        # Where a contender's gateway answers /metrics when requests go elsewhere (Envoy before the EPP).
        self.metrics_urls: dict[str, str] = {}

    # Pods

    def _start_pods(self, speed: float, prefill_pods: int = 0, lora_on_demand: bool = False,
                    scheduling: Literal["fcfs", "priority"] = "fcfs"
                    ) -> tuple[MockPodFleet | None, list[PodConfig]]:
        if self.existing_pods:
            if prefill_pods:
                raise RuntimeError("prefill/decode contenders need simulated pods with roles")
            self._reset_existing()
            # Existing pods schedule as they were started: a priority contender names them so.
            return None, [msgspec.structs.replace(p, scheduling=scheduling) for p in self.existing_pods]
        fleet = MockPodFleet(MockPodsConfig(count=self.pods, model=self.model, block_size=self.block_size,
                                            num_blocks=self.num_blocks, speed=speed, prefill_pods=prefill_pods,
                                            # Outputs as long as the trace's max_tokens, not the quick
                                            # start's answers that end.
                                            ends_answers=False,
                                            max_model_len=self.max_model_len or MODEL_MAX_LEN,
                                            connector="nixl", enable_lora=bool(self._adapters),
                                            lora_adapters=[] if lora_on_demand else self._adapters,
                                            max_loras=self.max_loras, scheduling=scheduling,
                                            per_process=self.pods_per_process), quiet=True)
        try:
            return fleet, fleet.start()
        except BaseException:
            fleet.stop()  # the pods it had spawned: none is the caller's to stop yet
            raise

    def _reset_existing(self) -> None:
        """Start each contender from cold caches where the engine allows it."""
        for pod in self.existing_pods or []:
            path = "/flush_cache" if pod.flavor == "sglang" else "/reset_prefix_cache"
            with contextlib.suppress(OSError):
                urllib.request.urlopen(urllib.request.Request(pod.url + path, method="POST"), timeout=10).close()

    # Routers

    def _start_routers(self, contender: Contender, pods: list[PodConfig]) -> list[str] | None:
        if contender.kind == "direct":
            return None
        env = dict(contender.env)
        if contender.kind == "gateway" and contender.replicas > 1 and contender.share_state:
            env["GATEWAY_SHARED_STATE__REDIS_URL"] = self._start_redis()
        if contender.lora_on_demand:
            env["GATEWAY_MODELS__ADAPTERS"] = json.dumps(
                {name: {"path": f"/adapters/{name}", "base_model": self.model} for name in self._adapters})
        if contender.kind == "envoy-epp":
            return [self._start_envoy_epp(contender, pods, env)]
        return [self._start_router(contender, pods, env) for _ in range(contender.replicas)]

    def _start_envoy_epp(self, contender: Contender, pods: list[PodConfig], env: dict[str, str]) -> str:
        """``gateway epp`` and a real Envoy in front of the pods (override-host cluster, fallbacks); the
        EPP's HTTP port (metrics) is kept in ``metrics_urls``; Envoy's URL is the one requests go to."""
        grpc_port, envoy_port, admin_port = free_port(), free_port(), free_port()
        epp_url = self._start_router(contender, pods, {**env, "GATEWAY_EPP__PORT": str(grpc_port),
                                                       "GATEWAY_EPP__ACCESS_LOG": "true"})
        endpoints = [tuple(p.url.split("://", 1)[1].split(":")) for p in pods]
        config = bootstrap_yaml(listen_port=envoy_port, admin_port=admin_port, epp=("127.0.0.1", grpc_port),
                                pods=[(host, int(port)) for host, port in endpoints], cluster="override_host")
        path = os.path.join(tempfile.mkdtemp(prefix="kvgw-envoy-"), "envoy.yaml")
        with open(path, "w") as f:
            f.write(config)
        with self._router_log(contender) as log:
            proc = subprocess.Popen([_binary("envoy"), "-c", path, "--concurrency", "1", "--disable-hot-restart",
                                     "-l", "warning"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self._procs.append(proc)
        self.router_processes.append(proc)
        wait_http(f"http://127.0.0.1:{admin_port}/ready", 60, proc)
        self.metrics_urls[contender.name] = epp_url
        return f"http://127.0.0.1:{envoy_port}"

    def _start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (make install)")
        port = free_port()
        self._redis = start_redis_server(binary, port)
        self._procs.append(self._redis)
        return f"redis://127.0.0.1:{port}/0"

    def _stop_redis(self) -> None:
        if self._redis is not None and self._redis.poll() is None:
            self._redis.terminate()

    def _start_router(self, contender: Contender, pods: list[PodConfig], extra_env: dict[str, str]) -> str:
        port = free_port()
        env = {**os.environ, **extra_env}
        if contender.kind in ("gateway", "envoy-epp"):
            cmd = self._gateway_command(contender, pods, port, env)
            served = ServedBy("kv-gateway", gateway_version(), None, cmd)
        else:
            peer = self.peer(contender.kind)
            if contender.kind == "vllm-router":
                cmd = self._vllm_router_command(peer.path, contender, pods, port, env)
            else:  # sglang-router and smg share one command line
                cmd = [peer.path, "launch", "--host", "127.0.0.1", "--port", str(port),
                       "--policy", contender.policy, *_workers(pods, "--pd-disaggregation", "--worker-urls")]
            served = ServedBy(peer.package, peer.version, peer.reported, cmd)
        if self.served_by is NOBODY:  # the first of its routers
            self.served_by = served
        with self._router_log(contender) as log:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self._procs.append(proc)
        self.router_processes.append(proc)
        url = f"http://127.0.0.1:{port}"
        # The gateway listens before its tokenizers have loaded and its pods answered: its /readyz says when
        # it is ready (a peer has none; its /v1/models answers once it is).
        wait_http(f"{url}/readyz" if contender.kind == "gateway" else f"{url}/v1/models", 90, proc)
        return url

    def peer(self, kind: str) -> PeerBinary:
        """The peer's binary from its own environment, checked once per runner (PeerMissing, PeerRefused)."""
        if kind not in self._peers:
            self._peers[kind] = resolve_peer(PEERS[kind])
        return self._peers[kind]

    def _router_log(self, contender: Contender) -> contextlib.AbstractContextManager[IO[bytes] | int]:
        """Where a router's stdout and stderr go: a new file under ``router_logs``, or nowhere (a split
        run's gateway: a temporary file, its access records read back)."""
        splitting = self.split_dir is not None and contender.kind in ("gateway", "envoy-epp")
        if self.router_logs is None and not splitting:
            return contextlib.nullcontext(subprocess.DEVNULL)
        directory = self.router_logs or tempfile.mkdtemp(prefix="kvgw-bench-logs-")
        os.makedirs(directory, exist_ok=True)
        n = self._logs_per_contender[contender.name]
        self._logs_per_contender[contender.name] += 1
        path = os.path.join(directory, f"{contender.name}-{n}.log")
        if splitting:
            self._access_logs.append(path)
        return open(path, "wb")

    def _gateway_command(self, contender: Contender, pods: list[PodConfig], port: int,
                         env: dict[str, str]) -> list[str]:
        command = "epp" if contender.kind == "envoy-epp" else "serve"
        cmd = [sys.executable, "-m", "gateway", command, "--port", str(port), "--policy", contender.policy]
        if contender.kind == "gateway":
            cmd += ["--workers", str(contender.workers)]
        for p in pods:
            spec = p.url + (f",events={p.kv_events}" if p.kv_events else "") + \
                (f",replay={p.kv_replay}" if p.kv_replay else "") + f",name={p.name},role={p.role}" + \
                (f",scheduling={p.scheduling}" if p.scheduling != "fcfs" else "")
            cmd += ["--pod", spec]
        # A split run reads each request's record back (bench.split); else the records cost CPU for nothing.
        env["GATEWAY_LOGGING__ACCESS_LOG"] = "true" if self.split_dir is not None else "false"
        if self.split_dir is not None:
            env["GATEWAY_LOGGING__JSON"] = "true"
        env["GATEWAY_DISAGGREGATION__CONNECTOR"] = "nixl"
        if self.tokenizer:  # else the gateway asks the pods' /tokenize (a contender may name its own)
            env.setdefault("GATEWAY_TOKENIZATION__MODELS", json.dumps({self.model: {"path": str(self.tokenizer)}}))
        return cmd

    def _vllm_router_command(self, binary: str, contender: Contender, pods: list[PodConfig], port: int,
                             env: dict[str, str]) -> list[str]:
        cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", contender.policy,
               *_workers(pods, "--vllm-pd-disaggregation", "--worker-urls"), "--log-level", "warning"]
        if contender.policy == "kv_aware":
            for p in pods:
                if p.kv_events:
                    cmd += ["--kv-event-source", f"{p.url}={p.kv_events}"]
                if p.kv_replay:
                    cmd += ["--kv-event-replay-source", f"{p.url}={p.kv_replay}"]
            cmd += ["--kv-event-block-size", str(self._pods_block_size(pods)), "--kv-event-model", self.model]
            if self.tokenizer:
                env["VLLM_ROUTER_TOKENIZER"] = str(self.tokenizer)
        return cmd

    def _pods_block_size(self, pods: list[PodConfig]) -> int:
        """The engines' block size, as their ``vllm:cache_config_info`` says (else the configured one)."""
        for pod in pods:
            if config := cache_config(pod.url):
                return config.block_size
        return pods[0].block_size or self.block_size

    def _stop_procs(self) -> None:
        stop_processes(self._procs)
        self._procs.clear()
        self.router_processes.clear()

    def _split(self, result: Result, ok: list[Outcome], pod_ttfts: dict[str, float],
               pod_queues: dict[str, float]) -> None:
        """Each answered request's TTFT split (bench.split) into ``<split_dir>/<scenario>-<contender>.csv``,
        its percentiles into the result; the access logs read are forgotten."""
        access: dict[str, dict[str, Any]] = {}
        for path in self._access_logs:
            with contextlib.suppress(OSError), open(path, "rb") as f:
                access.update(access_records(f))
        self._access_logs.clear()
        table = split_rows(((o.request_id, o.session, o.step, o.ttft_s) for o in ok), access, pod_ttfts, pod_queues)
        if self.split_dir is not None:
            write_rows(table, Path(self.split_dir) / f"{result.scenario}-{result.name}.csv")
        result.extra.update(split_summary(table))

    # One contender

    @contextlib.contextmanager
    def serving(self, contender: Contender, speed: float | None = None
                ) -> Iterator[tuple[list[str] | None, list[PodConfig]]]:
        """The pods (simulated ones started, existing ones reset) and the contender's routers in front of
        them (``None``: requests go straight to the pods), all stopped on leaving."""
        fleet = None
        self.served_by = NOBODY
        self._access_logs.clear()
        try:
            fleet, pods = self._start_pods(self.speed if speed is None else speed, contender.prefill_pods,
                                           contender.lora_on_demand, contender.scheduling)
            yield self._start_routers(contender, pods), pods
        finally:
            self._stop_procs()
            if fleet:
                fleet.stop()

    def run(self, contender: Contender, trace: Trace, speed: float | None = None) -> Result:
        result = Result(contender.name, contender.policy, trace.scenario, trace.seed, requests=trace.requests)
        self._adapters = trace.adapters
        lose_redis_after = (round(contender.redis_lost_at * trace.requests)
                            if contender.redis_lost_at is not None else None)
        try:
            with self.serving(contender, speed) as (routers, pods):
                caches = [cache_config(p.url) for p in pods]
                before = [self._prefix_counters(p.url) for p in pods]
                legs_before = [_leg_counters(p.url) for p in pods]
                decode_urls = [p.url for p in pods if p.role != "prefill"]
                # The gateway's own metrics: the routers', or behind Envoy the EPP's HTTP port.
                gateway_metrics = ([self.metrics_urls[contender.name]] if contender.kind == "envoy-epp"
                                   else routers if contender.kind == "gateway" else None)
                gateway_before = _metrics_texts(gateway_metrics) if gateway_metrics else []
                cpu_before = [process_cpu_s(p.pid) for p in self.router_processes]
                indexer_before = sum(process_cpu_s(p.pid, INDEXER_NAME) for p in self.router_processes)
                switches_before = [process_switches(p.pid) for p in self.router_processes]
                outcomes, seconds = asyncio.run(self._replay(trace, routers, decode_urls, contender.name,
                                                             lose_redis_after))
                cpu = [process_cpu_s(p.pid) - b for p, b in zip(self.router_processes, cpu_before, strict=True)]
                indexer_cpu = sum(process_cpu_s(p.pid, INDEXER_NAME) for p in self.router_processes) - indexer_before
                memory = sum(process_memory_mb(p.pid) for p in self.router_processes)
                switches = [process_switches(p.pid) - b
                            for p, b in zip(self.router_processes, switches_before, strict=True)]
                after, spent = self._counters_after(pods, gateway_metrics)
                legs_after = [_leg_counters(p.url) for p in pods]
                pod_ttfts, pod_queues = _pod_ttfts(decode_urls)
                if contender.prefill_pods:
                    result.extra.update(_per_leg(pods, legs_before, legs_after))
                if trace.adapters:
                    result.extra.update(_adapter_switches(trace, legs_before, legs_after))
                if gateway_metrics:
                    result.extra.update(self._prediction_checks(gateway_metrics))
                    gateway_after = _metrics_texts(gateway_metrics)
                    result.extra.update(gateway_split(gateway_before, gateway_after))
                    result.extra.update(kv_ingest(gateway_before, gateway_after, seconds, indexer_cpu))
                if memory:
                    result.extra["router_memory_mb"] = round(memory, 1)
                if cpu and trace.requests:  # the router's CPU per request (Envoy's and the EPP's apart)
                    names = ["epp", "envoy"] if contender.kind == "envoy-epp" else ["router"] * len(cpu)
                    for name, seconds_, switched in zip(names, cpu, switches, strict=True):
                        key = f"cpu_ms_per_req_{name}"
                        result.extra[key] = round(result.extra.get(key, 0.0) + 1000 * seconds_ / trace.requests, 3)
                        key = f"switches_per_req_{name}"
                        result.extra[key] = round(result.extra.get(key, 0.0) + switched / trace.requests, 2)
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            result.skipped = str(exc)
            return result
        finally:
            result.package, result.version, result.reported_version, command = self.served_by
            result.command = list(command)
        # The pods' counters count the gateway's keep-warm refreshes too (those they finished, and the prompt
        # tokens of those they aborted): they are no client's requests.
        refreshes = [spent.get(p.name or "", KeepWarmSpent()) for p in pods]
        queries = sum(a[0] - b[0] - r.prompt_tokens for a, b, r in zip(after, before, refreshes, strict=True))
        hits = sum(a[1] - b[1] - r.cached_tokens for a, b, r in zip(after, before, refreshes, strict=True))
        result.pod_requests = [round(a[2] - b[2] - r.requests) for a, b, r in zip(after, before, refreshes,
                                                                                     strict=True)]
        self._keep_warm_cost(result, refreshes)
        served = sum(result.pod_requests)
        result.largest_share = max(result.pod_requests) / served if served else 0.0
        ok = [o for o in outcomes if o.status == 200]
        # The same ratio from the answers' own usage, where every answer says it (a check on the counters).
        if ok and all(o.cached_tokens is not None for o in ok):
            prompted = sum(o.prompt_tokens for o in ok)
            result.extra["client_hit_ratio"] = round(sum(o.cached_tokens or 0 for o in ok) / prompted, 4) \
                if prompted else 0.0
        result.hit_ratio = hits / queries if queries else 0.0
        if not contender.prefill_pods:
            result.extra.update(_added_ttft(ok, legs_before, legs_after))
            result.extra.update(_added_ttft_per_request(ok, pod_ttfts))
            if self.split_dir is not None:
                self._split(result, ok, pod_ttfts, pod_queues)
        result.extra["prompt_tokens"] = round(queries)  # the clients' (what a hit ratio's gain is a share of)
        result.errors = sum(1 for o in outcomes if o.status not in (200, 429))
        # The gateway's workflow cache actions, as shares of the answered requests.
        for action, n in Counter(o.cache_action for o in ok if o.cache_action).items():
            result.extra[f"action_{action}"] = round(n / len(ok), 4)
        result.rejected = sum(1 for o in outcomes if o.status == 429)
        ttft, e2e = [o.ttft_s * 1000 for o in ok], [o.e2e_s * 1000 for o in ok]
        result.ttft_p50_ms, result.ttft_p90_ms, result.ttft_p99_ms = (pct(ttft, q) for q in (0.5, 0.9, 0.99))
        result.e2e_p50_ms, result.e2e_p90_ms, result.e2e_p99_ms = (pct(e2e, q) for q in (0.5, 0.9, 0.99))
        result.req_per_s = len(ok) / seconds if seconds else 0.0
        result.session_p50_ms = pct(session_times(outcomes), 0.5)
        result.busy_p50_ms = pct(busy_times(outcomes), 0.5)
        result.tenants = tenant_stats(trace, outcomes, trace.duration_s or seconds)
        oracle = self._oracle(trace, caches, {(o.session, o.step): o.answer for o in outcomes})
        if oracle:
            result.infinite, result.sticky_lru, result.keep_warm = oracle.infinite, oracle.sticky_lru, oracle.keep_warm
            result.distance = oracle.sticky_lru - result.hit_ratio
        return result

    def _oracle(self, trace: Trace, caches: list[CacheConfig | None],
                answers: dict[tuple[int, int], str]) -> Oracle | None:
        """The trace's references for these pods and answers; none without a local tokenizer, or when a pod
        does not say its cache size or the pods' block sizes differ."""
        if not self.tokenizer or None in caches or len({c.block_size for c in caches if c}) != 1:
            return None
        key = (caches, answers)
        if self._last_oracle and self._last_oracle[0] is trace and self._last_oracle[1] == key:
            return self._last_oracle[2]
        if self._encoder is None:
            self._encoder = ChatEncoder(HfTokenizer(self.tokenizer))
        known = [c for c in caches if c]
        oracle = trace_oracle(trace, self._encoder, answers, known[0].block_size, [c.num_blocks for c in known])
        self._last_oracle = (trace, key, oracle)
        return oracle

    @staticmethod
    def _prediction_checks(routers: list[str]) -> dict[str, float]:
        """How the gateway's own checks of its predictions came out (``prediction_<outcome>``), and
        whether any model drifted: a benchmark must not pass while routing silently degrades."""
        checks: dict[str, float] = {}
        for url in routers:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
                for key, value in prediction_checks(resp.read().decode()).items():
                    if key == "drift":  # any replica's drift
                        checks[key] = max(checks.get(key, 0.0), value)
                    else:
                        checks[key] = checks.get(key, 0.0) + value
        return checks

    def _counters_after(self, pods: list[PodConfig], routers: list[str] | None
                        ) -> tuple[list[tuple[float, float, float]], dict[str, KeepWarmSpent]]:
        """The pods' counters after a run, and what the gateway's keep-warm spent on each pod, read so that
        both agree: a refresh may still be answered as a run ends (contexts think after their last request)."""
        for _ in range(50):
            first = [self._prefix_counters(p.url) for p in pods]
            spent = self._keep_warm_spent(routers) if routers else {}
            if [self._prefix_counters(p.url) for p in pods] == first:
                return first, spent
            time.sleep(0.1)
        raise RuntimeError("the pods' counters kept moving after the run")

    @staticmethod
    def _keep_warm_spent(routers: list[str]) -> dict[str, KeepWarmSpent]:
        total: dict[str, KeepWarmSpent] = {}
        for url in routers:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
                for pod, spent in keep_warm_spent(resp.read().decode()).items():
                    was = total.get(pod, KeepWarmSpent())
                    total[pod] = KeepWarmSpent(*(a + b for a, b in zip(was, spent, strict=True)))
        return total

    @staticmethod
    def _keep_warm_cost(result: Result, refreshes: list[KeepWarmSpent]) -> None:
        """What keep-warm spent: refreshes, and the prompt tokens the pods computed for them (the rest hit)."""
        sent = sum(r.requests + r.cancelled for r in refreshes)
        if sent:
            result.extra["keep_warm_refreshes"] = sent
            result.extra["keep_warm_computed_tokens"] = sum(r.prompt_tokens - r.cached_tokens for r in refreshes)
            result.extra["keep_warm_cached_tokens"] = sum(r.cached_tokens for r in refreshes)

    @staticmethod
    def _prefix_counters(url: str) -> tuple[float, float, float]:
        """The pod's prompt tokens looked up, of those found cached, and requests finished."""
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            values = parse_engine_metrics(resp.read().decode())
        return values.get("prefix_queries", 0.0), values.get("prefix_hits", 0.0), values.get("requests_finished", 0.0)

    async def _replay(self, trace: Trace, routers: list[str] | None, pod_urls: list[str],
                      label: str, lose_redis_after: int | None = None) -> tuple[list[Outcome], float]:
        targets = itertools.cycle(routers or pod_urls)
        outcomes: list[Outcome] = []
        # A real progress bar on a terminal; nothing on a pipe (CI logs) or when asked for none.
        bar = tqdm(total=trace.requests, desc=f"  {label}", unit="req", file=sys.stderr, leave=True,
                   disable=not self.progress or not sys.stderr.isatty())
        # The trace and everything built so far are never freed during the replay: out of the collector's
        # sight, so that its full collections (over 100 ms each on the Mooncake slice, eleven of them) do
        # not stall the client and count as the routers' time to first token.
        gc.collect()
        gc.freeze()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
            t0 = time.monotonic()

            ends = t0 + trace.duration_s if trace.duration_s is not None else None

            async def run_session(index: int, session: Session) -> None:
                await asyncio.sleep(max(0.0, t0 + session.start_s - time.monotonic()))
                history = History(session)
                for i, step in enumerate(session.steps):
                    think = step.think_s if step.think_s is not None else session.think_s
                    if i and think:
                        await asyncio.sleep(think)
                    if ends is not None and time.monotonic() >= ends:
                        break
                    outcome = await self._send(http, next(targets), history.prompt(step), step.max_tokens,
                                               step.headers, step.model)
                    outcome.session, outcome.step = index, i
                    outcomes.append(outcome)
                    if len(outcomes) == lose_redis_after:
                        self._stop_redis()
                    bar.update(1)
                    history.answered(outcome.answer)

            await asyncio.gather(*(run_session(i, s) for i, s in enumerate(trace.sessions)))
            seconds = time.monotonic() - t0
        bar.close()
        gc.unfreeze()
        return outcomes, seconds

    async def _send(self, http: aiohttp.ClientSession, base: str, messages: list[dict[str, object]],
                    max_tokens: int, headers: dict[str, str], model: str | None = None) -> Outcome:
        body = {"model": model or self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        request_id = f"{self._run_id}-{next(self._request_ids):x}"
        started = time.monotonic()
        first: float | None = None
        parts: list[str] = []
        usage: dict[str, object] = {}
        try:
            async with http.post(f"{base}/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"content-type": "application/json", "x-request-id": request_id,
                                          **headers}) as resp:
                if resp.status != 200:
                    await resp.read()
                    return Outcome(resp.status, sent_at=started, request_id=request_id)
                action = resp.headers.get("x-gateway-cache-action", "")
                usage: dict[str, Any] = {}
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = orjson.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            first = first or time.monotonic()
                            parts.append(content)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return Outcome(599, sent_at=started, request_id=request_id)
        end = time.monotonic()
        details = usage.get("prompt_tokens_details") or {}
        return Outcome(200, (first or end) - started, end - started, started, action, "".join(parts),
                       prompt_tokens=int(usage.get("prompt_tokens") or 0), cached_tokens=details.get("cached_tokens"),
                       completion_tokens=int(usage.get("completion_tokens") or 0), request_id=request_id)

