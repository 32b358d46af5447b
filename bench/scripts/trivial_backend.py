"""A backend that answers every chat request with the same small completion, as fast as aiohttp can.

Used to measure what the gateway itself adds (``bench/scripts/proxy_overhead.py``).
"""

from __future__ import annotations

import sys

import orjson
from aiohttp import web

ANSWER = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001},
})
MODELS = orjson.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]})


async def chat(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")


async def models(request: web.Request) -> web.Response:
    return web.Response(body=MODELS, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.Response()


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    import uvloop

    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
