"""The simulated pod's Anthropic Messages endpoint, answered as vLLM 0.32 answers it: the request
converted to a chat conversation (:mod:`gateway.tokenization.anthropic`), the model's chat template applied, and
the answer in Anthropic's shape, streamed as ``event:``/``data:`` pairs. Like vLLM's, the usage splits
the prompt three ways: ``cache_read_input_tokens`` (found cached), ``cache_creation_input_tokens`` (the
prompt's other full blocks, cached by this request) and ``input_tokens`` (the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from gateway.core.inference_api import InferenceRequest
from gateway.tokenization import anthropic
from gateway.tokenization.hf import HfTokenizer
from simulator.engine import Sequence


def prompt_ids(tokenizer: HfTokenizer, body: dict[str, Any]) -> list[int]:
    """The prompt vLLM renders for a Messages request (ValueError when it cannot be rendered here).
    ``thinking`` and ``output_config`` become chat-template arguments on vLLM, which the simulated model's
    template does not read: they change nothing here (the gateway, not knowing the template, routes such a
    request by its approximate prefix)."""
    req = InferenceRequest(messages=body.get("messages"), system=body.get("system"), tools=body.get("tools"),
                           tool_choice=body.get("tool_choice"))
    if not isinstance(req.messages, list) or not req.messages:
        raise ValueError("messages must be a non-empty list")
    try:
        messages = anthropic.chat_messages(req, tokenizer.system_first)
    except anthropic.NotRenderable as exc:
        raise ValueError(f"the simulated pod cannot render this request: {exc}") from None
    return tokenizer.encode_chat(messages, tools=anthropic.chat_tools(req),
                                 chat_template_kwargs=body.get("chat_template_kwargs"))


def usage(seq: Sequence, block_size: int) -> dict[str, int]:
    created = seq.prompt_len // block_size * block_size - seq.cached_tokens
    return {"input_tokens": seq.prompt_len - seq.cached_tokens - created, "cache_read_input_tokens": seq.cached_tokens,
            "cache_creation_input_tokens": created, "output_tokens": seq.generated}


def message(seq: Sequence, model: str, text: str, block_size: int) -> dict[str, Any]:
    return {"id": f"msg_{seq.request_id}", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": _stop_reason(seq), "stop_sequence": None,
            "usage": usage(seq, block_size)}


def error(status: int, message_text: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "api_error"
    body = {"type": "error", "error": {"type": kind, "message": message_text}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def stream(request: web.Request, seq: Sequence, model: str, text_of: Callable[[int], str],
                 block_size: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
    await resp.prepare(request)
    start = {**message(seq, model, "", block_size), "content": [], "stop_reason": None}
    start["usage"] = {**usage(seq, block_size), "output_tokens": 0}
    await resp.write(_event("message_start", {"type": "message_start", "message": start}))
    await resp.write(_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}}))
    async for token in seq.tokens():
        await resp.write(_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                        "delta": {"type": "text_delta", "text": text_of(token)}}))
    await resp.write(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    await resp.write(_event("message_delta", {"type": "message_delta", "usage": usage(seq, block_size),
                                              "delta": {"stop_reason": _stop_reason(seq), "stop_sequence": None}}))
    await resp.write(_event("message_stop", {"type": "message_stop"}))
    await resp.write_eof()
    return resp


def _stop_reason(seq: Sequence) -> str:
    return "end_turn" if seq.ended else "max_tokens"


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"
