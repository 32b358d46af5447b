"""The kits of what the gateway knows of its pods: their load (GPU profiles, engine metrics, predicted
output lengths, pressure modes) and what each caches (the KV index fed by the engines' events, the
approximate index, the working set of contexts)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

from gateway.api import debug
from gateway.config import GatewayConfig
from gateway.kits.foundation import Foundation, SharedState
from gateway.kits.kit import EVERY_KIT, Kit, Route, Running
from gateway.kv._blockindex import BlockIndex
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.free_queue import FreeQueues
from gateway.kv.index import PrefixIndex
from gateway.kv.subscriptions import KvEventService, KvMetricsCollector
from gateway.kv.verification import PredictionVerifier
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.pending import PendingLoad
from gateway.load.predictor import OutputLengthPredictor
from gateway.load.pressure_modes import PressureModes
from gateway.load.slo_profiles import ProfileStore
from gateway.pods.registry import PodRegistry
from gateway.pods.scraper import MetricsScraper
from gateway.request.context_steps import ContextPlacement, PlacementLosses, RoutedPrefix
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.sessions import SessionAffinity


class LoadKit(Kit):
    """Each pod's load: GPU profiles, its engine's metrics (scraped), the output lengths predicted, and
    the pressure mode each pod is in."""

    name = "load"
    requires = ("foundation",)

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState) -> None:
        lc = config.load
        pods = base.pods
        self.modes = PressureModes()
        self.profiles = ProfileStore(lc.redis_url, lc.profile_refresh_s)
        self.load = PendingLoad(self.profiles, shared.ledger, lc.default_capacity,
                                lambda name: deployment_of(pods, name), lc.embedding_share,
                                blocked=self.modes.in_emergency)
        self.predictor = OutputLengthPredictor(lc.predictor_window_s, lc.predictor_slot_s, lc.cold_start,
                                               lc.max_output_tokens, lc.predictor_percentile)
        self.capacity_of = kv_capacity(pods, self.load)
        ledger = shared.ledger
        self.scraper = (MetricsScraper(pods, self.load.engine, base.http, lc.scrape_interval_s,
                                       max_per_s=lc.max_scrapes_per_s / base.identity.count,
                                       busy=lambda pod: ledger.on_pod(pod) > 0)
                        if lc.scrape_interval_s > 0 else None)

    def running(self) -> Iterable[Running]:
        scraper = [Running(self.scraper.start, self.scraper.stop)] if self.scraper is not None else []
        return [Running(self.profiles.start, self.profiles.stop), *scraper]


class KvKit(Kit):
    """What each pod caches: the prefix index its engine's KV events feed, the approximate index, the
    working set of contexts, the sessions pinned to a pod, the free queues keep-warm reads, the check of
    predicted hits, and the steps that read and keep them (``/debug/index``). The events'
    subscribers start with the pods' membership (:class:`~gateway.kits.fleet.FleetKit`)."""

    name = "kv"
    requires = ("shared_state",)

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState, load: LoadKit) -> None:
        identity, ki, sinks = base.identity, config.kv_index, shared.sinks
        keeping_warm = config.workflow.enabled and config.workflow.keep_warm.enabled
        self.queues = FreeQueues() if keeping_warm else None
        # With the host's indexers (gateway/indexer.py), this worker reads the index they write.
        host_index = ([BlockIndex(path=identity.index_path(shard), writer=False)
                       for shard in range(ki.ingest_processes)] if identity.index_dir is not None else None)
        self.index = PrefixIndex(ki.max_blocks_per_view, ki.speculative_ttl_s, sinks.index,
                                 reported_block_size=partial(reported_block_size, load.load),
                                 evictions=self.queues, stores=host_index, max_views=ki.max_views)
        self.approximate = ApproximatePrefixIndex()
        self.events = KvEventService(self.index)
        base.metrics.registry.register(KvMetricsCollector(self.events, exports_host=identity.index == 0))
        self.working_set = ResumableWorkingSet(config.placement, shared.ledger, sinks.working_set,
                                               anonymous_prefix=f"anon-{identity.origin}-")
        # The sessions pinned to a pod (workflow.max_sessions): they go with the pod's cache when it leaves.
        self.sessions = SessionAffinity(shared.ledger, config.workflow.max_sessions, sinks.sessions)
        self.verifier = PredictionVerifier(config.verification, base.metrics)
        # The steps that read and keep what each pod caches, and where cache hits were lost (/debug/placement).
        self.losses = PlacementLosses(base.metrics)
        self.placement = ContextPlacement(self.index, self.working_set, self.losses)
        self.routed = RoutedPrefix(self.index, self.approximate)
        self._page = partial(debug.index_page, base.auth, self.events, self.verifier)

    def routes(self) -> Iterable[Route]:
        return [Route("GET", "/debug/index", self._page)]


class TokensKit(Kit):
    """The tokenizers (loaded on a thread once the gateway listens) and the pods' ``/tokenize``."""

    name = "tokens"
    requires = (EVERY_KIT,)  # last: the load takes a second or more of CPU, which the others' starts need not wait

    def __init__(self, config: GatewayConfig, base: Foundation, shared: SharedState) -> None:
        self.tokens = TokenizationService(config.tokenization, base.pods, base.metrics, base.http, shared.ledger)

    def running(self) -> Iterable[Running]:
        return [Running(self.tokens.start, self.tokens.stop)]


def kv_capacity(pods: PodRegistry, load: PendingLoad) -> Callable[[str], float | None]:
    """A pod's KV capacity in tokens: its config's, else what its engine's metrics said, else unknown."""

    def capacity_of(name: str) -> float | None:
        pod = pods.get(name)
        if pod is not None and pod.config.kv_capacity_tokens:
            return float(pod.config.kv_capacity_tokens)
        stats = load.engine.get(name)
        return stats.kv_capacity_tokens if stats is not None and stats.kv_capacity_tokens > 0 else None

    return capacity_of


def reported_block_size(load: PendingLoad, pod: str) -> int | None:
    """The block size the pod's engine metrics say (vLLM's ``cache_config_info``), if they say one."""
    stats = load.engine.get(pod)
    return int(stats.block_size) if stats is not None and stats.block_size > 0 else None


def deployment_of(pods: PodRegistry, name: str) -> str:
    pod = pods.get(name)
    return (pod.config.deployment or pod.name) if pod else name
