"""The simulated pod's Responses API (``/v1/responses``), answered as vLLM 0.32 answers it.

The request's input items become a chat conversation (:mod:`gateway.tokenization.openai_responses`), rendered by the
model's chat template and tokenized with the tokenizer's special tokens, as vLLM does. The answer is vLLM's
``ResponsesResponse``, whole or as its event stream (``event: <type>`` then ``data: <json>``, numbered by
``sequence_number``): ``response.created``, ``response.in_progress``, the output item's events, then
``response.completed`` with the whole response. The usage is the Responses API's (``input_tokens``,
``input_tokens_details.cached_tokens`` and ``cache_write_tokens``, ``output_tokens``). The model's output is
the pod's fixed text, or, where the request requires a tool call (``tool_choice`` ``required`` or a named
function), a call of its first function tool.

Like vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE`` (the pod config's ``responses_store``), a pod may keep the
responses it answered in its memory: then ``previous_response_id`` continues one (its earlier turns'
messages, less system messages, and the text of its output messages), ``GET /v1/responses/{id}`` returns
it, and ``POST .../cancel`` refuses a finished one. Without the store nothing is kept and every id is
unknown (404).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway.tokenization import openai_responses
from gateway.tokenization.anthropic import NotRenderable
from gateway.tokenization.hf import HfTokenizer
from simulator.engine import Sequence

# A function tool's fields as vLLM echoes them in the response, in its order, with its defaults.
_TOOL_FIELDS = ("name", "parameters", "strict", "type", "allowed_callers", "async", "defer_loading", "description",
                "output_schema")


@dataclass(slots=True)
class ResponseStore:
    """vLLM's in-memory store: each response, and the messages its input became."""

    responses: dict[str, dict[str, Any]] = field(default_factory=dict)
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def conversation(body: dict[str, Any], store: ResponseStore | None) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a Responses body (ValueError when it refuses the body; KeyError
    naming a ``previous_response_id`` it does not hold)."""
    if "input" not in body:
        raise ValueError("input: Field required")
    previous: list[dict[str, Any]] = []
    if (previous_id := body.get("previous_response_id")) is not None:
        if store is None or previous_id not in store.responses:
            raise KeyError(previous_id)
        previous = [m for m in store.messages.get(previous_id, []) if m.get("role") != "system"]
        for item in store.responses[previous_id]["output"]:
            if item.get("type") == "message":
                previous += [{"role": "assistant", "content": part["text"]} for part in item["content"]]
    try:
        new = openai_responses.chat_messages(body.get("instructions"), body["input"])
    except NotRenderable as exc:
        raise ValueError(f"Unsupported input: {exc}") from None
    system = new[:1] if new and body.get("instructions") else []
    return [*system, *previous, *new[len(system):]]


def prompt_ids(tokenizer: HfTokenizer, body: dict[str, Any], messages: list[dict[str, Any]]) -> list[int]:
    return tokenizer.encode_chat(messages, tools=openai_responses.chat_tools(body.get("tools")),
                                 chat_template_kwargs=body.get("chat_template_kwargs"),
                                 add_special_tokens=openai_responses.SPECIAL_TOKENS)


def not_found(response_id: str) -> web.Response:
    return error(404, f"Response with id '{response_id}' not found.", "response_id")


def error(status: int, message: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class ResponseWriter:
    """One response as vLLM builds it, whole or event by event."""

    def __init__(self, body: dict[str, Any], seq: Sequence, model: str, block_size: int,
                 text_of: Callable[[int], str]) -> None:
        self.body = body
        self.seq = seq
        self.model = model
        self.block_size = block_size
        self.text_of = text_of
        self.id = body.get("request_id") if isinstance(body.get("request_id"), str) else new_id("resp")
        self.created = int(time.time())
        self.call = _required_call(body)
        self.item_id = new_id("fc" if self.call else "msg")
        self.call_id = new_id("call")
        self._sequence = 0

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        body = self.body
        tools = [_echoed_tool(t) for t in body.get("tools") or [] if isinstance(t, dict)]
        return {
            "id": self.id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": self.model,
            "object": "response", "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": 1.0, "tool_choice": body.get("tool_choice", "auto") if tools else "none", "tools": tools,
            "top_p": 1.0, "background": False, "max_output_tokens": self.seq.max_tokens, "max_tool_calls": None,
            "previous_response_id": body.get("previous_response_id"), "prompt": None, "reasoning": None,
            "service_tier": "auto", "status": status, "text": None, "top_logprobs": None, "truncation": "disabled",
            "usage": usage, "user": body.get("user"), "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None,
        }

    def usage(self) -> dict[str, Any]:
        seq = self.seq
        written = seq.prompt_len // self.block_size * self.block_size - seq.cached_tokens
        return {"input_tokens": seq.prompt_len,
                "input_tokens_details": {"cached_tokens": seq.cached_tokens, "cache_write_tokens": max(0, written),
                                         "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                "output_tokens": seq.generated,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                "total_tokens": seq.prompt_len + seq.generated}

    def item(self, text: str, done: bool) -> dict[str, Any]:
        if self.call is not None:
            return {"arguments": text if done else "", "call_id": self.call_id, "name": self.call,
                    "type": "function_call", "id": self.item_id, "namespace": None,
                    "status": "completed" if done else "in_progress"}
        content = [_part(text, None)] if done else []
        return {"id": self.item_id, "content": content, "role": "assistant",
                "status": "completed" if done else "in_progress", "type": "message", "phase": None}

    def whole(self, text: str) -> dict[str, Any]:
        return self.response([self.item(self.arguments(text), True)], self.status, self.usage())

    def arguments(self, text: str) -> str:
        """A tool call's arguments: one string argument holding the model's text."""
        return orjson.dumps({"input": text}).decode() if self.call is not None else text

    @property
    def status(self) -> str:
        return "completed" if self.seq.ended else "incomplete"

    def event(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {**data, "sequence_number": self._sequence, "type": kind}
        self._sequence += 1
        return f"event: {kind}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"

    async def stream(self, request: web.Request, store: ResponseStore | None,
                     messages: list[dict[str, Any]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        started = self.response([], "in_progress", None)
        await resp.write(self.event("response.created", {"response": started}))
        await resp.write(self.event("response.in_progress", {"response": started}))
        where = {"item_id": self.item_id, "output_index": 0}
        await resp.write(self.event("response.output_item.added", {"item": self.item("", False), "output_index": 0}))
        if self.call is None:
            await resp.write(self.event("response.content_part.added",
                                        {"content_index": 0, **where, "part": _part("", [])}))
        text = []
        async for token in self.seq.tokens():
            piece = self.text_of(token)
            text.append(piece)
            if self.call is None:
                await resp.write(self.event("response.output_text.delta", {"content_index": 0, "delta": piece,
                                                                           "item_id": self.item_id, "logprobs": [],
                                                                           "output_index": 0}))
        whole = "".join(text)
        if self.call is None:
            await resp.write(self.event("response.output_text.done", {"content_index": 0, "item_id": self.item_id,
                                                                      "logprobs": [], "output_index": 0,
                                                                      "text": whole}))
            await resp.write(self.event("response.content_part.done",
                                        {"content_index": 0, **where, "part": _part(whole, None)}))
        else:
            arguments = self.arguments(whole)
            await resp.write(self.event("response.function_call_arguments.delta", {"delta": arguments, **where}))
            await resp.write(self.event("response.function_call_arguments.done",
                                        {"arguments": arguments, **where, "name": self.call}))
        final = self.whole(whole)
        await resp.write(self.event("response.output_item.done", {"item": final["output"][0], "output_index": 0}))
        self.keep(store, final, messages)
        await resp.write(self.event("response.completed", {"response": final}))
        await resp.write_eof()
        return resp

    def keep(self, store: ResponseStore | None, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        if store is not None and self.body.get("store", True):
            store.responses[self.id] = response
            store.messages[self.id] = messages


def _part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {name: tool.get(name) for name in _TOOL_FIELDS}


def _required_call(body: dict[str, Any]) -> str | None:
    """The function tool the request makes the model call (``tool_choice`` required, or naming one)."""
    functions = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("name") in functions:
        return str(choice["name"])
    return str(functions[0]) if choice == "required" and functions else None
