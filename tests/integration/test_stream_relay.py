"""SSE relay: bytes and chunk order identical to the pod's; a client disconnect reaches the pod."""

from __future__ import annotations

import asyncio

from aiohttp import web

from tests.conftest import chat_body, eventually, models_of

# Chunks cut at awkward places: mid-event, mid-UTF-8 character, several events at once.
CHUNKS = [
    b'data: {"choices":[{"delta":{"content":"Hel',
    b'lo"}}]}\n\ndata: {"choices":[{"delta":{"content":"\xc3',
    b'\xa9"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n',
]


def stepping_backend(step: asyncio.Event, sent: list[bytes]) -> web.Application:
    """Sends one chunk, then waits for the test to allow the next: proves the relay holds nothing but the part
    of an event still to come (a whole event is checked before it goes on: gateway/proxy/events.py)."""

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in CHUNKS:
            await step.wait()
            step.clear()
            await resp.write(chunk)
            sent.append(chunk)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/v1/models", models_of("m"))
    return app


async def test_stream_is_relayed_chunk_by_chunk_byte_identical(start_backend, start_gateway, http):
    step, sent = asyncio.Event(), []
    gw = await start_gateway([await start_backend(stepping_backend(step, sent))])
    received = bytearray()
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m", stream=True)) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for i in range(len(CHUNKS)):
            step.set()
            await eventually(lambda n=i: len(sent) > n)
            # Each whole event reaches the client before the pod is allowed to send the next chunk.
            so_far = b"".join(CHUNKS[: i + 1])
            whole = so_far[: so_far.rfind(b"\n\n") + 2] if b"\n\n" in so_far else b""
            while len(received) < len(whole):
                received += await asyncio.wait_for(resp.content.readany(), timeout=5)
            assert bytes(received) == whole
        assert await resp.content.read() == b""
    assert sent == CHUNKS
    assert received.endswith(b"data: [DONE]\n\n")
    metrics = (await (await http.get(f"{gw.url}/metrics")).text())
    # Usage rides in the last data event; the gateway counted it.
    assert 'gateway_tokens_total{kind="completion",model="m"} 2.0' in metrics


async def test_client_disconnect_mid_stream_cancels_upstream(start_backend, start_gateway, http):
    upstream_gone = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
                await asyncio.sleep(0.05)
        except (ConnectionResetError, asyncio.CancelledError):
            upstream_gone.set()
            raise

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    app.router.add_get("/v1/models", models_of("m"))
    gw = await start_gateway([await start_backend(app)])
    await gw.serving("m")
    resp = await http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="m", stream=True))
    assert (await resp.content.readany()).startswith(b"data: ")
    resp.close()  # the client hangs up mid-stream
    await asyncio.wait_for(upstream_gone.wait(), timeout=10)
    pod = gw.kits.foundation.pods.all()[0]
    for _ in range(100):
        if gw.kits.shared.ledger.on_pod(pod.name) == 0:
            break
        await asyncio.sleep(0.02)
    assert gw.kits.shared.ledger.on_pod(pod.name) == 0


async def test_client_disconnect_aborts_the_request_on_a_mock_pod(start_mock_pod, start_gateway, http):
    pod = await start_mock_pod(speed=1.0)
    gw = await start_gateway([pod.url])
    body = chat_body(max_tokens=2000, stream=True)
    resp = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    assert (await resp.content.readany()).startswith(b"data: ")
    resp.close()
    for _ in range(200):
        if pod.aborted_requests:
            break
        await asyncio.sleep(0.02)
    assert pod.aborted_requests == 1
    assert not pod.engine.running and not pod.engine.waiting
