"""Engine metrics scraper: each pod's ``/metrics`` (vLLM or SGLang names) every interval, jittered, within a
budget of scrapes per second (a large fleet: the pods with requests in flight each interval, the others in turn;
:mod:`gateway.pods.rotation`).

Owner: the :class:`MetricsScraper` alone writes :class:`~gateway.load.pending.EngineStats`. A failed
scrape keeps the last values and marks them stale, so routing falls back to the gateway's own counts.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import Callable

import aiohttp

from gateway.background import cancel_and_wait
from gateway.http_client import HttpClient
from gateway.load.pending import EngineStats
from gateway.pods.registry import Pod, PodRegistry
from gateway.pods.rotation import Rotation

log = logging.getLogger("gateway.scraper")

# Metric name → EngineStats field, for both engines. Values of one name are summed over label sets
# (e.g. several vLLM engines behind one server).
METRIC_FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # before vLLM 0.10
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:request_success_total": "requests_finished",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:prompt_tokens_total": "prefix_queries",
    "sglang:cached_tokens_total": "prefix_hits",
    "sglang:num_requests_total": "requests_finished",
    "sglang:max_total_num_tokens": "kv_capacity_tokens",
}
# vLLM says its cache size in the labels of an info metric: num_gpu_blocks x block_size (and so, before
# its first KV event, how it cuts prompts into blocks).
_CACHE_CONFIG_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# vLLM's LoRA gauge: a series per label set it was ever set with, its value the time it was last set.
_LORA_INFO = re.compile(r'^vllm:lora_requests_info\{([^}]*)\}\s+(\S+)', re.MULTILINE)


def parse_lora_info(text: str) -> tuple[tuple[str, ...], tuple[str, ...], int] | None:
    """The adapters running and waiting, and ``max_lora``, from the latest ``vllm:lora_requests_info``
    series (none: the engine serves no LoRA)."""
    latest: tuple[float, str] | None = None
    for found in _LORA_INFO.finditer(text):
        try:
            at = float(found.group(2))
        except ValueError:
            continue
        if latest is None or at > latest[0]:
            latest = (at, found.group(1))
    if latest is None:
        return None
    labels = dict(_LABEL.findall(latest[1]))

    def names(key: str) -> tuple[str, ...]:
        return tuple(n for n in labels.get(key, "").split(",") if n)

    try:
        max_loras = int(labels.get("max_lora", "0"))
    except ValueError:
        max_loras = 0
    return names("running_lora_adapters"), names("waiting_lora_adapters"), max_loras


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The fields of ``METRIC_FIELDS`` found in a Prometheus text exposition."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name == _CACHE_CONFIG_INFO:
            blocks, block_size = _cache_config(line)
            if block_size:
                values["kv_capacity_tokens"] = values.get("kv_capacity_tokens", 0.0) + blocks * block_size
                values["block_size"] = block_size
            continue
        field = METRIC_FIELDS.get(name)
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        values[field] = values.get(field, 0.0) + value
    return values


def _cache_config(line: str) -> tuple[float, float]:
    """``(num_gpu_blocks, block_size)`` of a ``cache_config_info`` line; zeros where it says neither."""
    labels = dict(_LABEL.findall(line))
    try:
        return float(labels["num_gpu_blocks"]), float(labels["block_size"])
    except (KeyError, ValueError):
        return 0.0, 0.0


class MetricsScraper:
    def __init__(self, pods: PodRegistry, stats: dict[str, EngineStats], http: HttpClient,
                 interval_s: float = 0.5, timeout_s: float = 1.0, max_per_s: float = 0.0,
                 busy: Callable[[str], bool] = lambda pod: False) -> None:
        """``max_per_s``: scrapes a second at most (0: every pod every interval); ``busy``: whether a pod has
        requests in flight (scraped first)."""
        self._pods = pods
        self._rotation = Rotation(max_per_s)
        self._busy = busy
        self.stats = stats
        self._http = http
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The first scrape before the gateway serves (each pod's bounded by the timeout): the first
        requests already see each engine's capacity and block size."""
        await self.scrape_all()
        self._task = asyncio.create_task(self._loop(), name="metrics-scraper")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s * random.uniform(0.8, 1.2))
            due = self._rotation.due(self._pods.all(), self._interval_s, lambda pod: self._busy(pod.name))
            await asyncio.gather(*(self.scrape(p) for p in due))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(p) for p in self._pods.all()))

    async def scrape(self, pod: Pod) -> None:
        stats = self.stats.setdefault(pod.name, EngineStats())
        try:
            async with self._http.session.get(f"{pod.url}/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                text = await resp.text()
                values = parse_engine_metrics(text)
                lora = parse_lora_info(text) if "vllm:lora_requests_info" in text else None
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            stats.failures += 1
            if not stats.stale:
                log.warning("scraping %s failed; keeping its last values (stale): %s", pod.name, exc)
            stats.stale = True
            return
        for field, value in values.items():
            setattr(stats, field, value)
        if lora is not None:
            stats.lora_running, stats.lora_waiting, stats.max_loras = lora
        stats.scraped_at = time.monotonic()
        stats.stale = False
