"""Components start in order and stop in reverse, each one stopped even when another fails to stop."""

from __future__ import annotations

import pytest
from aiohttp import web

from gateway.kits.kit import EVERY_KIT, Kit, KitOrderError, Running, lifecycle, lifecycles, start_order


class Component:
    def __init__(self, name: str, log: list[str], fail_start: bool = False, fail_stop: bool = False) -> None:
        self.name, self.log, self.fail_start, self.fail_stop = name, log, fail_start, fail_stop

    async def start(self) -> None:
        if self.fail_start:
            raise RuntimeError(f"{self.name} cannot start")
        self.log.append(f"start {self.name}")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        if self.fail_stop:
            raise RuntimeError(f"{self.name} failed to stop")


def app_of(components: list[Component]) -> web.Application:
    app = web.Application()
    app.cleanup_ctx.extend(lifecycle(c.start, c.stop) for c in components)
    return app


async def test_stop_in_reverse_even_when_one_fails():
    log: list[str] = []
    runner = web.AppRunner(app_of([Component("http", log), Component("health", log, fail_stop=True),
                                   Component("kv", log)]))
    await runner.setup()
    with pytest.raises(Exception, match="health failed to stop"):
        await runner.cleanup()
    assert log == ["start http", "start health", "start kv", "stop kv", "stop health", "stop http"]


async def test_a_failed_start_stops_what_had_started():
    from gateway.serve import start_runner

    log: list[str] = []
    runner = web.AppRunner(app_of([Component("http", log), Component("health", log, fail_start=True),
                                   Component("kv", log)]))
    with pytest.raises(RuntimeError, match="health cannot start"):
        await start_runner(runner)
    assert log == ["start http", "stop http"]


class Feature(Kit):
    def __init__(self, name: str, log: list[str], requires: tuple[str, ...] = ()) -> None:
        self.name, self.requires, self.part = name, requires, Component(name, log)

    def running(self) -> list[Running]:
        return [Running(self.part.start, self.part.stop)]


def test_kits_start_after_what_they_require_and_stop_before_it():
    """The order comes from each kit's declared requirements; kits that need nothing of each other keep the
    order they were composed in, and the one that requires every kit starts last."""
    log: list[str] = []
    kits = [Feature("tokens", log, (EVERY_KIT,)), Feature("flow", log, ("fleet",)), Feature("http", log),
            Feature("fleet", log, ("http",)), Feature("store", log)]
    assert [k.name for k in start_order(kits)] == ["http", "fleet", "flow", "store", "tokens"]


async def test_kits_lifecycles_run_in_their_start_order():
    log: list[str] = []
    app = web.Application()
    app.cleanup_ctx.extend(lifecycles([Feature("flow", log, ("http",)), Feature("http", log)]))
    runner = web.AppRunner(app)
    await runner.setup()
    await runner.cleanup()
    assert log == ["start http", "start flow", "stop flow", "stop http"]


def test_a_missing_or_circular_requirement_is_refused_at_assembly():
    with pytest.raises(KitOrderError, match="requires"):
        start_order([Feature("flow", [], ("fleet",))])
    with pytest.raises(KitOrderError, match="circle"):
        start_order([Feature("a", [], ("b",)), Feature("b", [], ("a",))])
