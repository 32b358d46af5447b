"""The host's indexer (gateway/indexer.py): one process applies the pods' KV events into shared memory, and
the workers route by reading it in place. Real simulated pods, real ZeroMQ, real processes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec

from gateway.cluster.identity import WorkerIdentity
from gateway.config import load_config
from gateway.indexer import Indexer, shard_of
from gateway.kv._blockindex import BlockIndex
from gateway.kv.index import PrefixIndex
from simulator.pod import free_port
from tests.integration.test_kv_subscriber import eventually
from tests.integration.test_server_process import gateway_subprocess, stop_cleanly, wait_ready
from tests.unit.test_prefix_index import Notes

MODEL = "mock-llama"


def prompt(seed: int, blocks: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 4000) for _ in range(16 * blocks + 1)]


async def complete(http: aiohttp.ClientSession, url: str, ids: list[int]) -> None:
    async with http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}) as resp:
        assert resp.status == 200, await resp.text()


async def test_indexers_share_the_pods_and_readers_see_every_block_and_eviction(start_mock_pod, http, tmp_path):
    """Two indexers, each for its share of four pods; a reader of both finds what each pod caches, names its
    holders, and hears the pods' evictions; the indexers' counters reach the reader."""
    pods = [await start_mock_pod(num_blocks=64) for _ in range(4)]
    configs = [msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"} for i, p in enumerate(pods)]
    config = load_config(overrides={"pods": configs, "kv_index": {"ingest_processes": 2},
                                    "health": {"interval_s": 0.2}}, environ={})
    identity = WorkerIdentity("r", 0, 2, str(tmp_path), str(tmp_path))
    indexers = [Indexer(config, identity, shard) for shard in range(2)]
    for indexer in indexers:
        await indexer.start()
    notes = Notes()
    reader = PrefixIndex(stores=[BlockIndex(path=identity.index_path(s), writer=False) for s in range(2)],
                         evictions=notes)
    try:
        assert {shard_of(f"pod{i}", 2) for i in range(4)} == {0, 1}  # both indexers have pods
        await eventually(lambda: len(reader.views()) == 4)
        reader.follow_notes()
        for i, pod in enumerate(pods):
            await complete(http, pod.url, prompt(i))
        names = [f"pod{i}" for i in range(4)]
        await eventually(lambda: all(reader.lookup(MODEL, None, prompt(i), names)[f"pod{i}"].gpu_tokens == 320
                                     for i in range(4)))
        for i in range(4):
            assert reader.holders(reader.prompt_hashes(MODEL, None, prompt(i)), limit=4) == [f"pod{i}"]
        for seed in range(10, 14):  # four more prompts of 20 blocks each into pod0's 63: its first one goes
            await complete(http, pods[0].url, prompt(seed))
        await eventually(lambda: reader.lookup(MODEL, None, prompt(0), ["pod0"])["pod0"].gpu_tokens < 320)
        await eventually(lambda: reader.follow_notes() > 0 or any(kind == "evicted" for kind, _, _ in notes.told))
        assert {pod for kind, pod, _ in notes.told if kind == "evicted"} == {"pod0"}
        for indexer in indexers:
            indexer.kv.mirror_counters()
        counters = {v.pod: dict(zip(("batches", "applied"), v.store.counters(v.bit)[:2], strict=True))
                    for v in reader.views()}
        assert all(c["applied"] >= 1 and c["batches"] >= c["applied"] for c in counters.values())
    finally:
        for indexer in indexers:
            await indexer.stop()


async def every_worker_sees_every_pod(http: aiohttp.ClientSession, url: str, workers: int, pods: int) -> None:
    """Wait until each worker has seen every pod pass its health check. A gateway is ready once a worker is,
    and each worker checks the pods itself: one that found them still starting asks again up to a check
    interval later, and meanwhile routes among the pods it has seen."""
    ready: set[str] = set()
    for _ in range(300):
        async with http.get(f"{url}/debug/pods") as resp:
            if sum(pod["healthy"] for pod in (await resp.json())["pods"]) == pods:
                ready.add(resp.headers["x-gateway-worker"])
        if len(ready) == workers:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"only workers {sorted(ready)} saw all {pods} pods healthy")


async def holders_blocks_indexed(index_of_a_worker: Callable[[], Awaitable[dict]], pod: str, at_least: int,
                                 not_by: int | None = None) -> int:
    """Wait until a worker's ``/debug/index`` shows ``at_least`` blocks of ``pod`` (written by an indexer other
    than ``not_by``); the blocks shown. The indexer may connect to a pod seconds after it turned healthy
    (ZeroMQ's reconnect backoff while the pod was starting): its replay buffer then fills the index."""
    for _ in range(150):
        info = await index_of_a_worker()
        blocks = sum(view["blocks"] for view in info["views"] if view["pod"] == pod)
        if blocks >= at_least and not_by not in info["memory"]["writer_pids"]:
            return blocks
        await asyncio.sleep(0.1)
    raise AssertionError(f"{pod}'s blocks did not reach the index: {info}")


async def test_workers_route_by_the_indexers_index_and_survive_its_restart(tmp_path):
    """`serve --workers 2 --policy kv_aware`: no worker applies an event itself, yet a prompt returns to the pod
    holding it whichever worker takes it; a killed indexer is started again, rebuilds the index from the pods'
    replay buffers, and the workers route by it again."""
    port = free_port()
    log = tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": "You plan trips. " + " ".join(["itinerary"] * 300)},
        {"role": "user", "content": "Three days in Lisbon?"}]}
    async with (gateway_subprocess("--mock-pods", "3", "--mock-speed", "0", "--workers", "2", "--policy", "kv_aware",
                                "--port", str(port), log=log) as proc,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                      timeout=aiohttp.ClientTimeout(total=20)) as http):

        async def ask() -> tuple[str, str, int]:
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                cached = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
                return resp.headers["x-gateway-worker"], resp.headers["x-gateway-pod"], cached

        async def index_of_a_worker() -> dict:
            async with http.get(f"{url}/debug/index") as resp:
                return await resp.json()

        await wait_ready(url, http, proc)
        await every_worker_sees_every_pod(http, url, workers=2, pods=3)
        first_worker, holder, _ = await ask()
        held = await holders_blocks_indexed(index_of_a_worker, holder, at_least=250 // 16)
        seen = {first_worker}
        for _ in range(12):
            worker, pod, cached = await ask()
            seen.add(worker)
            assert pod == holder and cached > 250
        assert seen == {"w0", "w1"}
        info = await index_of_a_worker()
        assert info["applied_here"] is False and len(info["views"]) == 3
        (indexer_pid,) = info["memory"]["writer_pids"]
        assert indexer_pid not in (os.getpid(), proc.pid)
        os.kill(indexer_pid, signal.SIGKILL)
        await holders_blocks_indexed(index_of_a_worker, holder, at_least=held, not_by=indexer_pid)
        for _ in range(4):
            _, pod, cached = await ask()
            assert pod == holder and cached > 250
        await stop_cleanly(proc)
        text = log.read_text()
        assert "indexer 0 exited" in text and "Traceback" not in text
