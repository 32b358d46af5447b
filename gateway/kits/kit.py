"""What a feature hands the assembly: a *kit* builds the feature's state and steps, and says what of it runs
(starts and stops), which HTTP routes it serves, which config sections it reloads, and which kits must be
running before it starts.

:func:`start_order` derives the start order from those declarations (a kit starts after the kits it
requires; kits that do not depend on each other start in the order the assembly composed them), and
:func:`lifecycles` turns it into aiohttp ``cleanup_ctx`` entries: started in that order, stopped in
reverse, each one stopped even if another fails to stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.api.routes import Route

log = logging.getLogger("gateway.app")
SLOW_STOP_S = 2.0  # a component that takes longer to stop is named in the log: a slow shutdown says who
EVERY_KIT = "*"  # in ``requires``: start after every other kit (the tokenizers: their load takes a core)

Lifecycle = Callable[[web.Application], AsyncIterator[None]]
Start = Callable[[], Awaitable[None] | None]
Stop = Callable[[], Awaitable[None]]
Apply = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class Running:
    """One part of a kit with a lifetime: ``start`` when the gateway starts, ``stop`` when it stops."""

    start: Start
    stop: Stop | None = None


class Kit:
    """One feature, assembled. Subclasses name themselves and the kits they need running before they start,
    build their parts in their constructor, and override what they contribute."""

    name: str  # unique in the assembly: what other kits name in their requires
    requires: tuple[str, ...] = ()  # the kits that must be running before this one starts (or EVERY_KIT)

    def running(self) -> Iterable[Running]:
        """The parts with a lifetime, in the order they start (they stop in reverse)."""
        return ()

    def routes(self) -> Iterable[Route]:
        """The HTTP routes it serves, each handler bound to the parts of the kit it reads."""
        return ()

    def reloads(self) -> Mapping[str, Apply]:
        """Config section → what applies a reloaded one (:class:`~gateway.config_reload.ConfigReloader`)."""
        return {}

    def checks(self) -> Mapping[str, Apply]:
        """Config section → what checks a reloaded one before any section applies (raises when it is bad)."""
        return {}


class KitOrderError(ValueError):
    """A kit requires one the assembly lacks, or kits require each other in a circle."""


def start_order(kits: Sequence[Kit]) -> list[Kit]:
    """``kits`` in the order they start: each after the kits it requires; ties in the order given."""
    names = {kit.name for kit in kits}
    needs: dict[str, set[str]] = {}
    for kit in kits:
        wanted = names - {kit.name} if EVERY_KIT in kit.requires else set(kit.requires)
        if missing := wanted - names:
            raise KitOrderError(f"kit {kit.name} requires {sorted(missing)}, which the assembly lacks")
        needs[kit.name] = wanted
    out: list[Kit] = []
    started: set[str] = set()
    while len(out) < len(kits):
        ready = next((k for k in kits if k.name not in started and needs[k.name] <= started), None)
        if ready is None:
            left = sorted(names - started)
            raise KitOrderError(f"kits that require each other in a circle: {left}")
        out.append(ready)
        started.add(ready.name)
    return out


def lifecycle(start: Start, stop: Stop | None = None) -> Lifecycle:
    """A ``cleanup_ctx`` entry: ``start`` when the app starts, ``stop`` when it stops."""

    async def run(app: web.Application) -> AsyncIterator[None]:
        started = start()
        if started is not None:
            await started
        yield
        if stop is not None:
            began = time.monotonic()
            await stop()
            if (took := time.monotonic() - began) > SLOW_STOP_S:
                log.warning("stopping %s took %.1f s", getattr(stop, "__qualname__", stop), took)

    return run


def lifecycles(kits: Sequence[Kit]) -> list[Lifecycle]:
    """Every kit's running parts, in start order (they stop in reverse)."""
    return [lifecycle(part.start, part.stop) for kit in start_order(kits) for part in kit.running()]
