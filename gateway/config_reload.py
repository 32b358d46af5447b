"""Reloading the config without a restart.

The config file is read again when its bytes change (checked every ``server.config_watch_interval_s``: a
Kubernetes ConfigMap mounted as a volume changes in place) or when the process gets SIGHUP. What applies
live is handed to its owner: ``flow_control`` (flows, tenants and their weights, objectives, API-key
tenants, token weights, saturation thresholds, queue limits), all but ``enabled``, which decides whether the
flow-control step is in the pipeline at all; ``models`` (public names, splits, fallbacks, adapters);
``limits`` (token and concurrency limits per key and tenant); and ``routing`` (the default policy, the
declared profiles, the shipped ones' options, the shortlist size), all but ``max_retries`` and
``allow_strategy_header``. Any other section or field that changed is logged as waiting for a restart, and
counted. A file that cannot be read or does not validate (routing profiles included: each is built before
anything is applied) is logged and counted, and the running config stays whole: a reload applies everything
it can or nothing.

Owner: the :class:`ConfigReloader` owns the config source in force (the last valid one read) and whether
the last reload worked. The parts it applies are owned by their components (flow control: the
:class:`~gateway.flow.controller.FlowController`; models: :class:`~gateway.models.rules.ModelRules` and the
adapters; limits: :class:`~gateway.limits.enforcer.KeyLimits`; routing: the
:class:`~gateway.routing.router.Router`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.background import cancel_and_wait
from gateway.config import ConfigError, ConfigSource, GatewayConfig, file_digest

log = logging.getLogger("gateway.config")

# The sections of the config that apply without a restart (the shipped kits' ``reloads()``; the assembly's
# reloader takes them from its kits, so a new kit's section is live without a line here), less the fields of
# theirs that need one (they decide what is built: whether flow control is in the pipeline; what the director
# was given).
LIVE_SECTIONS = frozenset({"flow_control", "models", "limits", "routing"})
RESTART_FIELDS = {"flow_control": ("enabled",), "routing": ("max_retries", "allow_strategy_header")}
OUTCOMES = ("applied", "unchanged", "restart_needed", "invalid")


def as_running(section: str, fresh: Any, running: Any) -> Any:
    """Section ``fresh`` with the fields that need a restart as they run (``running``'s)."""
    kept = RESTART_FIELDS.get(section, ())
    return msgspec.structs.replace(fresh, **{f: getattr(running, f) for f in kept}) if kept else fresh


def changed_sections(old: GatewayConfig, new: GatewayConfig,
                     live_sections: Collection[str] = LIVE_SECTIONS) -> tuple[list[str], list[str]]:
    """The sections (or fields) that differ, split into (applied live, needing a restart)."""
    live, restart = [], []
    for name in old.__struct_fields__:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if name not in live_sections:
            restart.append(name)
            continue
        restart += [f"{name}.{f}" for f in RESTART_FIELDS.get(name, ()) if getattr(before, f) != getattr(after, f)]
        if as_running(name, after, before) != before:
            live.append(name)
    return live, restart


class ReloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._reloads = Counter(
            "gateway_config_reloads", "Config reloads by outcome: applied, unchanged, restart_needed (some change "
            "waits for a restart; the live ones were applied), invalid (the running config stays)", ["outcome"],
            registry=registry)
        self._successful = Gauge("gateway_config_last_reload_successful",
                                 "1 when the last config reload was read and applied, 0 when it was refused",
                                 registry=registry)
        self._successful.set(1)
        for outcome in OUTCOMES:
            self._reloads.labels(outcome)

    def observe(self, outcome: str) -> None:
        self._reloads.labels(outcome).inc()
        self._successful.set(0 if outcome == "invalid" else 1)


class ConfigReloader:
    def __init__(self, source: ConfigSource, appliers: Mapping[str, Callable[[Any], None]], metrics: ReloadMetrics,
                 interval_s: float, checks: Mapping[str, Callable[[Any], None]] | None = None,
                 live_sections: Collection[str] = LIVE_SECTIONS) -> None:
        """``appliers``: each live section's owner, by section, taking the section whole; ``checks``: for a
        section whose validity only its owner can judge (``routing``: its plugins' options), a call that raises
        what applying it would, run before anything is applied; ``live_sections``: the sections that apply
        without a restart."""
        self._live_sections = frozenset(live_sections)
        self.source = source
        self._appliers = dict(appliers)
        self._checks = dict(checks or {})
        self._metrics = metrics
        self._interval_s = interval_s
        self._digest = source.digest  # the bytes the running config was read from
        self._asked: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.source.path:
            self._asked = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="config-reload")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def request(self) -> None:
        """Read the file again now, changed or not (SIGHUP)."""
        if self._asked is not None:
            self._asked.set()

    async def _run(self) -> None:
        assert self._asked is not None
        while True:
            forced = False
            try:
                async with asyncio.timeout(self._interval_s or None):
                    await self._asked.wait()
                forced = True
            except TimeoutError:
                pass
            self._asked.clear()
            digest = await asyncio.to_thread(file_digest, self.source.path)
            if forced or digest != self._digest:
                self._digest = digest  # a bad file is reported once, not at every check
                await self.reload()

    async def reload(self) -> str:
        """Read the source again and apply what applies live; returns the outcome (see :data:`OUTCOMES`)."""
        try:
            fresh = await asyncio.to_thread(self.source.reread)
        except (ConfigError, OSError, ValueError) as exc:
            log.error("config reload refused, the running config stays: %s", exc)
            self._metrics.observe("invalid")
            return "invalid"
        self._digest = fresh.digest
        live, restart = changed_sections(self.source.loaded, fresh.loaded, self._live_sections)
        running = self._running(fresh.loaded, live)
        try:
            for name in live:
                if (check := self._checks.get(name)) is not None:
                    check(getattr(running, name))
        except (ConfigError, ValueError, LookupError) as exc:  # the plugins' errors: a bad name or options
            log.error("config reload refused, the running config stays: %s", exc)
            self._metrics.observe("invalid")
            return "invalid"
        for name in live:
            if (apply := self._appliers.get(name)) is not None:
                apply(getattr(running, name))
        # What waits for a restart stays as it runs, so that it is reported again until then.
        self.source = msgspec.structs.replace(fresh, loaded=running)
        outcome = "restart_needed" if restart else "applied" if live else "unchanged"
        if restart:
            log.warning("config reloaded: %s applied; %s changed and applies after a restart",
                        ", ".join(live) or "nothing", ", ".join(restart))
        elif live:
            log.info("config reloaded: %s applied", ", ".join(live))
        self._metrics.observe(outcome)
        return outcome

    def _running(self, fresh: GatewayConfig, live: list[str]) -> GatewayConfig:
        """The config in force after a reload: the live sections from ``fresh`` (less the fields that need a
        restart), the rest as they were."""
        old = self.source.loaded
        return msgspec.structs.replace(old, **{name: as_running(name, getattr(fresh, name), getattr(old, name))
                                               for name in live})
