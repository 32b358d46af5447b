"""OpenAI's Responses API (``POST /v1/responses``) as vLLM renders it: its input items as a chat conversation.

vLLM 0.32 answers a Responses request by converting it to chat messages and applying the model's chat
template (``vllm/entrypoints/openai/responses/utils.py``, ``construct_input_messages``). To route it
precisely, the gateway converts it the same way:

- ``instructions`` become a leading system message;
- a string ``input`` is one user message; a list's items become messages in order: an item with a
  ``role`` is a message as it is (an assistant's output-text parts become its text), a ``function_call``
  (or ``custom_tool_call``) joins the preceding assistant message's ``tool_calls`` (or starts one), a
  ``function_call_output`` (or ``custom_tool_call_output``) is a ``tool`` message, a ``reasoning`` item
  the assistant's ``reasoning``;
- function ``tools`` become chat function tools (``{"type": "function", "function": {...}}``), a namespace's
  functions too (``<namespace>__<name>``), a custom tool a function of one string argument.

vLLM then tokenizes the rendered prompt *with* the tokenizer's special tokens (chat completions do not add
them): a Llama prompt starts with a second BOS (:data:`SPECIAL_TOKENS`). An item the gateway cannot
convert exactly (encrypted reasoning, types it does not know) makes the request not exactly renderable: it
is routed by its approximate prefix, and the pod says what is wrong with it.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.tokenization.anthropic import NotRenderable

# The tokenizer's special tokens are added to a Responses prompt (vLLM's default tokenize parameters).
SPECIAL_TOKENS = True
_CALLS = ("function_call", "custom_tool_call")
_CALL_OUTPUTS = ("function_call_output", "custom_tool_call_output")
# Custom tools' free-form input travels as a function call's arguments under this key (vLLM's shim).
_CUSTOM_INPUT_KEY = "input"


def chat_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """The chat conversation vLLM renders for a Responses request's ``instructions`` and ``input``."""
    messages: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list):
        raise NotRenderable("input is neither a string nor a list of items")
    for item in items:
        message = _message_of(item, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def _message_of(item: Any, previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The message an item becomes, or None when it joined ``previous`` (an assistant message)."""
    if not isinstance(item, dict):
        raise NotRenderable("an input item is not an object")
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in _CALLS:
        call = _tool_call(item)
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind in _CALL_OUTPUTS:
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        return _reasoning(item, assistant)
    if item.get("role") == "assistant" or (kind == "message" and item.get("role") == "assistant"):
        text = _assistant_text(item.get("content"))
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return item
    raise NotRenderable(f"input item of type {kind!r}")


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    name = item.get("name")
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({_CUSTOM_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
    else:
        arguments = item.get("arguments")
        if item.get("namespace"):
            raise NotRenderable("a namespaced tool call")
    return {"id": item.get("call_id"), "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(item: dict[str, Any], assistant: dict[str, Any] | None) -> dict[str, Any] | None:
    if item.get("encrypted_content"):
        raise NotRenderable("encrypted reasoning")
    parts = item.get("content") or item.get("summary") or []
    text = parts[0].get("text", "") if isinstance(parts, list) and parts and isinstance(parts[0], dict) else ""
    if assistant is not None and assistant.get("reasoning") is None:
        assistant["reasoning"] = text
        return None
    return {"role": "assistant", "reasoning": text}


def _assistant_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def chat_tools(tools: Any, tool_choice: Any = None) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (vLLM's ``construct_tool_dicts``): function tools; a
    namespace's functions as ``<namespace>__<name>``; a custom tool as a function of one string argument.
    Other Responses tools (web search, ...) are never shown to the model."""
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, tool.get("name")))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            out += [_function(t, f"{tool.get('name')}{_NAMESPACE_SEPARATOR}{t.get('name')}")
                    for t in tool["tools"] if isinstance(t, dict) and t.get("type") == "function"]
        elif kind == "custom":
            out.append(_function({"description": tool.get("description"), "parameters": _CUSTOM_PARAMETERS},
                                 tool.get("name")))
    return out or None


_NAMESPACE_SEPARATOR = "__"
_CUSTOM_PARAMETERS = {"type": "object", "properties": {_CUSTOM_INPUT_KEY: {
    "type": "string", "description": "The freeform text payload for this tool."}},
    "required": [_CUSTOM_INPUT_KEY], "additionalProperties": False}


def _function(tool: dict[str, Any], name: Any) -> dict[str, Any]:
    function = {"name": name, "description": tool.get("description"), "parameters": tool.get("parameters")}
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}
