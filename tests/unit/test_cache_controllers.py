"""The engines' cache controllers against a real HTTP server on loopback: how each reads its engine's answer to
a flush (each engine says a refusal its own way)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from gateway.config import PodConfig
from gateway.pods.registry import Pod
from plugins.cache_controllers.sglang import SglangCacheController
from plugins.cache_controllers.vllm import VllmCacheController
from simulator.pod import free_port


async def flush_answered(controller, path: str, status: int, body: str) -> tuple[str, str]:
    """``controller``'s flush of a pod that answers ``path`` with ``status`` and ``body``."""
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body)

    app = web.Application()
    app.router.add_post(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            return await controller.flush(session, Pod(config=PodConfig(name="p", url=url), name="p", url=url))
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("status", "body", "outcome"), [
    (200, '{"success": true}', "done"),
    (200, '{"success": false}', "refused"),  # blocks still in use
    (400, "", "refused"),
    (503, "busy", "refused"),
    (404, "", "failed"),  # VLLM_SERVER_DEV_MODE is off: retrying cannot help
])
async def test_vllm_reads_its_answer(status, body, outcome):
    got, detail = await flush_answered(VllmCacheController(), "/reset_prefix_cache", status, body)
    assert got == outcome
    assert (detail == "no /reset_prefix_cache (is VLLM_SERVER_DEV_MODE=1 set?)") == (status == 404)


@pytest.mark.parametrize(("status", "body", "outcome"), [
    (200, "Cache flushed.", "done"),
    (200, "Cache not flushed because there are pending requests.", "refused"),  # SGLang says so with a 200
    (500, "", "refused"),
    (404, "", "failed"),
])
async def test_sglang_reads_its_answer(status, body, outcome):
    assert (await flush_answered(SglangCacheController(), "/flush_cache", status, body))[0] == outcome


@pytest.mark.parametrize("controller", [VllmCacheController(), SglangCacheController()])
async def test_an_engine_that_cannot_be_asked_is_a_refusal_to_retry(controller):
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    async with aiohttp.ClientSession() as session:
        outcome, detail = await controller.flush(session, Pod(config=PodConfig(name="p", url=url), name="p", url=url))
    assert outcome == "refused" and "Cannot connect" in detail
