"""The gateway as a real process: start-up errors, readiness, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from simulator.pod import free_port
from tests.conftest import answers_ok, chat_body, eventually
from tests.integration.test_errors import backend


def gateway_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway", "serve", *args]


@asynccontextmanager
async def gateway_subprocess(*args: str, log: Path | None = None) -> AsyncIterator[asyncio.subprocess.Process]:
    """``gateway serve <args>`` as a process, its stderr piped, or written to ``log`` (a file, not a pipe,
    where nobody reads while it logs every request); killed on the way out if the test left it running."""
    if log is None:
        proc = await asyncio.create_subprocess_exec(*gateway_cmd(*args), stderr=asyncio.subprocess.PIPE)
    else:
        with log.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(*gateway_cmd(*args), stderr=stderr)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            # Bounded: a test that failed must not hang the suite if the exit is never reported to this loop.
            await asyncio.wait_for(proc.wait(), timeout=30)


async def stop_cleanly(proc: asyncio.subprocess.Process, timeout_s: float = 30) -> None:
    """SIGTERM, and the gateway exits with 0 within ``timeout_s``."""
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), timeout=timeout_s) == 0


def test_start_up_errors_are_one_clear_line():
    result = subprocess.run(gateway_cmd(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no pods configured" in result.stderr
    result = subprocess.run(gateway_cmd("--pod", "http://127.0.0.1:1", "--policy", "nope",
                                        "--port", str(free_port())),
                            capture_output=True, text=True, timeout=60)
    assert "unknown routing policy 'nope'" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run(gateway_cmd("--pod", "nothttp"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "$.pods[0]" in result.stderr


async def wait_ready(url: str, http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> None:
    if not await answers_ok(http, f"{url}/readyz", lambda: proc.returncode is None):
        assert proc.returncode is None, "gateway exited during start-up"
        raise AssertionError("gateway never became ready")


async def test_sigterm_drains_in_flight_stream(start_backend, http):
    release = asyncio.Event()

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"n": 1}\n\n')
        await release.wait()
        await resp.write(b'data: {"n": 2}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    pod = await start_backend(backend(slow_stream))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with gateway_subprocess("--pod", pod, "--port", str(port)) as proc:
        await wait_ready(url, http, proc)
        resp = await http.post(f"{url}/v1/chat/completions", json=chat_body(model="m", stream=True))
        assert await resp.content.readany() == b'data: {"n": 1}\n\n'
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert proc.returncode is None  # still draining the open stream
        release.set()
        rest = await asyncio.wait_for(resp.content.read(), timeout=10)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
        stderr = (await proc.stderr.read()).decode()
        assert "draining" in stderr and "gateway stopped" in stderr and "Traceback" not in stderr


async def test_serve_with_mock_pods_answers_an_openai_client(http):
    """What `make run` does: one command, simulated pods beside the gateway, an SDK client answered."""
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with gateway_subprocess("--mock-pods", "2", "--mock-speed", "0", "--port", str(port)) as proc:
        await wait_ready(url, http, proc)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["mock-llama"]
        pods = set()
        for _ in range(4):
            raw = await client.chat.completions.with_raw_response.create(
                model="mock-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=3)
            assert raw.parse().choices[0].message.content
            pods.add(raw.headers["x-gateway-pod"])
        assert pods == {"mock-0", "mock-1"}
        await client.close()
        await stop_cleanly(proc, timeout_s=20)


def status(pid: int) -> dict[str, str]:
    """The process's ``/proc/<pid>/status`` fields; none once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def alive(pid: int) -> bool:
    """Running, not gone and not a zombie."""
    return not status(pid).get("State", "Z").startswith("Z")


def live_children(parent: int, marker: bytes) -> set[int]:
    """The live processes whose parent is ``parent`` and whose command line holds ``marker``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry.name)
        if marker in cmdline and status(pid).get("PPid", "").strip() == str(parent) and alive(pid):
            found.add(pid)
    return found


async def test_simulated_pods_stop_when_their_gateway_is_killed_outright(http):
    """`serve --mock-pods` killed with SIGKILL (no chance to stop its pods): the pods notice and stop, so a
    crashed gateway or a failed test leaves no processes and ports behind."""
    port = free_port()
    async with gateway_subprocess("--mock-pods", "2", "--mock-speed", "0", "--port", str(port)) as proc:
        await wait_ready(f"http://127.0.0.1:{port}", http, proc)
        pods = live_children(proc.pid, b"gateway\x00mock")
        assert len(pods) == 2  # one process a pod when started beside a gateway
        proc.kill()
        # Bounded: the pods inherited the gateway's stderr pipe, and its end is reported once they are gone too.
        await asyncio.wait_for(proc.wait(), timeout=30)
    await eventually(lambda: not any(alive(pid) for pid in pods))  # they look for their parent once a second


async def test_workers_share_one_port_merge_metrics_and_are_restarted(tmp_path):
    """`serve --workers 2`: both workers answer on one port, /metrics counts every worker's requests, a
    killed worker is started again while the other serves, and SIGTERM stops them all."""
    import os

    port = free_port()
    log = tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    # A new connection per request: SO_REUSEPORT spreads connections, not requests.
    async with (gateway_subprocess("--mock-pods", "2", "--mock-speed", "0", "--workers", "2", "--port", str(port),
                                log=log) as proc,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                      timeout=aiohttp.ClientTimeout(total=20)) as http):
        await wait_ready(url, http, proc)
        workers: dict[str, int] = {}
        # Until each worker has said it is ready (its pods answered): /readyz reaches one worker of the two, and
        # beside other load the second was still waiting for its pods' first answers.
        for _ in range(600):
            async with http.get(f"{url}/readyz") as resp:
                if resp.status == 200:
                    async with http.get(f"{url}/debug/workers") as workers_resp:
                        info = await workers_resp.json()
                    assert workers_resp.headers["x-gateway-worker"] == info["worker"] and info["workers"] == 2
                    if resp.headers["x-gateway-worker"] == info["worker"]:
                        workers[info["worker"]] = info["pid"]
            if len(workers) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(workers) == 2, workers
        answered = set()
        for _ in range(20):
            async with http.post(f"{url}/v1/chat/completions", json=chat_body(model="mock-llama")) as resp:
                assert resp.status == 200
                answered.add(resp.headers["x-gateway-worker"])
        assert answered == {"w0", "w1"}
        text = await (await http.get(f"{url}/metrics")).text()
        counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("gateway_requests_total{") and 'route="/v1/chat/completions"' in line)
        assert counted == 20 and "gateway_workers 2.0" in text and "gateway_workers_unscraped 0.0" in text

        os.kill(workers["w1"], signal.SIGKILL)
        # A connection the kernel had queued for w1 as it died is reset (as with any SO_REUSEPORT
        # server): a client retries it once, and it reaches w0.
        for _ in range(10):  # the other worker serves meanwhile
            for attempt in range(2):
                try:
                    async with http.post(f"{url}/v1/chat/completions",
                                         json=chat_body(model="mock-llama")) as resp:
                        assert resp.status == 200
                    break
                except aiohttp.ClientOSError:
                    assert attempt == 0
        for _ in range(100):
            async with http.get(f"{url}/debug/workers") as resp:
                info = await resp.json()
            if info["worker"] == "w1" and info["pid"] != workers["w1"]:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("worker w1 was not started again")
        await stop_cleanly(proc)
        text = log.read_text()
        assert "worker w1 exited" in text and "Traceback" not in text


async def test_workers_stop_after_a_load_run_waiting_only_for_what_is_in_flight(start_backend, tmp_path):
    """`serve --workers 2` after a load run over kept-alive connections, with clients that gave up
    mid-request: SIGTERM waits for the one request still running, and for nothing else."""
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][0]["content"] == "slow":
            await release.wait()
        return web.json_response({"id": "x", "choices": []})

    pod = await start_backend(backend(answer))
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with (gateway_subprocess("--pod", pod, "--workers", "2", "--port", str(port),
                                log=tmp_path / "gateway.log") as proc,
                aiohttp.ClientSession() as http):  # kept-alive connections, open through the shutdown
        await wait_ready(f"http://127.0.0.1:{port}", http, proc)

        async def ask(content: str) -> int:
            async with http.post(url, json=chat_body(content, model="m")) as resp:
                await resp.read()
                return resp.status

        for _ in range(10):
            assert set(await asyncio.gather(*(ask("fast") for _ in range(16)))) == {200}
        quitters = [asyncio.create_task(ask("slow")) for _ in range(8)]
        await asyncio.sleep(0.2)
        for task in quitters:  # clients that gave up mid-request
            task.cancel()
        release.set()
        await asyncio.sleep(0.2)
        release.clear()
        in_flight = asyncio.create_task(ask("slow"))
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        assert proc.returncode is None  # draining the request still running
        release.set()
        assert await asyncio.wait_for(in_flight, timeout=10) == 200
        stopping = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
        assert asyncio.get_running_loop().time() - stopping < 3.0, "waited for something not in flight"
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()


def reloads_applied(metrics_text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith('gateway_config_reloads_total{outcome="applied"}'))


async def metrics_until(http: aiohttp.ClientSession, url: str, check: Callable[[str], bool], what: str) -> None:
    """Read the gateway's /metrics until ``check`` holds for them, for up to 10 s (else fail saying ``what``)."""
    for _ in range(200):
        if check(await (await http.get(f"{url}/metrics")).text()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(what)


async def bands_served(url: str, http: aiohttp.ClientSession, objective: str) -> set[int]:
    """Send one request under ``objective``, then read the bands flow control has served."""
    async with http.post(f"{url}/v1/chat/completions", json=chat_body(model="mock-llama"),
                         headers={"x-gateway-inference-objective": objective}) as resp:
        assert resp.status == 200
    async with http.get(f"{url}/debug/flows") as resp:
        return {flow["priority"] for flow in (await resp.json())["flows"]}


async def test_a_changed_config_file_applies_flow_control_without_a_restart(tmp_path, http):
    """One process watching its file: a new objective applies to the next request; a broken file is
    refused and the gateway serves on with what it had."""
    import yaml

    path, port = tmp_path / "gateway.yaml", free_port()
    config = {"server": {"port": port, "workers": 1, "config_watch_interval_s": 0.05},
              "mock_pods": {"count": 1, "speed": 0}, "flow_control": {"enabled": True}}
    path.write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(*gateway_cmd("--config", str(path)), stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, http, proc)
        assert await bands_served(url, http, "chat") == {0}  # not configured yet: no objective
        config["flow_control"]["objectives"] = {"chat": {"priority": 7}}
        path.write_text(yaml.safe_dump(config))
        await metrics_until(http, url, lambda text: reloads_applied(text) == 1, "the new objective was never read")
        assert await bands_served(url, http, "chat") == {0, 7}
        path.write_text("flow_control: {objectives: {chat: {priority: urgent}}}")
        await metrics_until(http, url, lambda text: "gateway_config_last_reload_successful 0.0" in text,
                            "the broken file was never read")
        async with http.post(f"{url}/v1/chat/completions", json=chat_body(model="mock-llama"),
                             headers={"x-gateway-inference-objective": "chat"}) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/debug/flows") as resp:
            served = {flow["priority"]: flow["service"] for flow in (await resp.json())["flows"]}
        assert set(served) == {0, 7}
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=30)
    log = stderr.decode()
    assert "config reloaded: flow_control applied" in log and "config reload refused" in log
    assert "Traceback" not in log


async def test_sighup_makes_every_worker_read_the_config_again(tmp_path):
    """`serve --workers 2` with the file unwatched: SIGHUP to the supervisor reaches both workers."""
    import yaml

    path, port = tmp_path / "gateway.yaml", free_port()
    config = {"server": {"port": port, "workers": 2, "config_watch_interval_s": 0},
              "mock_pods": {"count": 1, "speed": 0}, "flow_control": {"enabled": True}}
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    async with (gateway_subprocess("--config", str(path), log=log) as proc,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                      timeout=aiohttp.ClientTimeout(total=20)) as http):
        await wait_ready(url, http, proc)
        config["flow_control"]["tenants"] = {"A": {"weight": 4}}
        path.write_text(yaml.safe_dump(config))
        await asyncio.sleep(0.5)
        assert reloads_applied(await (await http.get(f"{url}/metrics")).text()) == 0  # not watched
        proc.send_signal(signal.SIGHUP)
        await metrics_until(http, url, lambda text: reloads_applied(text) == 2, "both workers did not reload")
        await stop_cleanly(proc)
    assert "Traceback" not in log.read_text()
