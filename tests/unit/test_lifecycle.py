"""Components start in order and stop in reverse, each one stopped even when another fails to stop."""

from __future__ import annotations

import pytest
from aiohttp import web

from gateway.kits.kit import lifecycle


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
    from gateway.server import start_runner

    log: list[str] = []
    runner = web.AppRunner(app_of([Component("http", log), Component("health", log, fail_start=True),
                                   Component("kv", log)]))
    with pytest.raises(RuntimeError, match="health cannot start"):
        await start_runner(runner)
    assert log == ["start http", "stop http"]
