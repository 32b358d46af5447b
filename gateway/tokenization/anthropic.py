"""The Anthropic Messages API (``POST /v1/messages``) as the engines render it.

vLLM (0.32 on) and SGLang answer it by converting the request to a chat completion and applying the
model's chat template. To route it precisely the gateway must tokenize exactly what the engine will, so
this module converts the same way vLLM does (``vllm/entrypoints/anthropic/serving.py``):

- ``system`` (a string or text blocks, less Claude Code's per-request ``x-anthropic-billing-header``
  block) becomes one leading system message; inline system messages stay where they are, unless the
  chat template refuses a system message after the first (then they join the leading one);
- text blocks become the content (a string for a single block, parts otherwise); ``tool_use`` blocks
  become the assistant's ``tool_calls``; a user's ``tool_result`` becomes a ``tool`` message;
  ``thinking`` becomes the message's ``reasoning``;
- ``tools`` become OpenAI function tools (``input_schema`` as ``parameters``), unless ``tool_choice``
  is ``none``.

What the gateway cannot reproduce exactly (images, thinking or effort settings, which change the
template's arguments) is reported as not exactly renderable: such a request is routed by its
approximate prefix, as any request the gateway cannot tokenize.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.core.errors import bad_request
from gateway.core.inference_api import InferenceRequest

BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = ("user", "assistant", "system")
# The content blocks of a message, as Anthropic's API defines them (the unions ``ContentBlockParam`` and
# ``BetaContentBlockParam`` of its SDK): what vLLM does not render it refuses, or the gateway routes
# approximately (images, documents), but a type outside these is no block at all.
BLOCK_TYPES = frozenset({
    "text", "image", "document", "search_result", "thinking", "redacted_thinking", "tool_use", "tool_result",
    "server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "tool_search_tool_result",
    "mcp_tool_use", "mcp_tool_result", "mcp_tool_listing", "container_upload", "compaction", "advisor_tool_result",
    "tool_addition", "tool_removal", "fallback"})
# The blocks of a tool result's content.
TOOL_RESULT_TYPES = frozenset({"text", "image", "search_result", "document", "tool_reference", "browser_state"})
# Block fields the gateway reads, and the types Anthropic's API gives them: required but for the ones
# :data:`_OPTIONAL` names.
_BLOCK_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "text": {"text": str},
    "thinking": {"thinking": str},
    "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str, "content": (str, list)},
}
_OPTIONAL = frozenset({"content"})


class NotRenderable(Exception):
    """The request holds something whose rendering the gateway cannot reproduce exactly."""


def check_request(req: InferenceRequest, *, counting: bool = False) -> None:
    """Refuse (400, naming the field) a Messages body whose parts the gateway reads are not shaped as
    Anthropic's API defines them: ``max_tokens`` (not for ``count_tokens``), ``messages``, their content
    blocks (of :data:`BLOCK_TYPES`; the fields of those the gateway reads), ``system`` and ``thinking``."""
    if not counting and req.max_tokens is None:
        raise bad_request("max_tokens: Field required.", param="max_tokens")
    if not req.messages:
        raise bad_request("messages: at least one message is required.", param="messages")
    last = len(req.messages) - 1
    for i, message in enumerate(req.messages):
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"messages.{i}.role: must be 'user' or 'assistant'.", param="messages")
        content = message.get("content")
        # Anthropic's API refuses an empty message (vLLM drops it: an empty conversation, refused there),
        # but for the final assistant message, the start of the answer.
        if not content and not (i == last and role == "assistant" and content is not None):
            raise bad_request(f"messages.{i}.content: must not be empty (only the final assistant message may be).",
                              param="messages")
        _check_content(content, f"messages.{i}.content")
    system = req.system
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system", only_text=True)
    if req.thinking is not None and not isinstance(req.thinking, dict):
        raise bad_request("thinking: must be an object.", param="thinking")


def _check_content(content: Any, where: str) -> None:
    if not isinstance(content, str):
        _check_blocks(content, where)


def _check_blocks(blocks: Any, where: str, only_text: bool = False,
                  kinds: frozenset[str] = BLOCK_TYPES) -> None:
    if not isinstance(blocks, list):
        raise bad_request(f"{where}: must be a string or a list of content blocks.", param=where.split(".")[0])
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or (only_text and kind != "text"):
            expected = "a text block" if only_text else "an object with a string `type`"
            raise bad_request(f"{where}.{j}: must be {expected}.", param=where.split(".")[0])
        if kind not in kinds:
            raise bad_request(f"{where}.{j}.type: must be one of {', '.join(sorted(kinds))}; got {kind[:40]!r}.",
                              param=where.split(".")[0])
        for name, types in _BLOCK_FIELDS.get(kind, {}).items():
            if (name in block or name not in _OPTIONAL) and not isinstance(block.get(name), types):
                raise bad_request(f"{where}.{j}.{name}: required for a {kind} block, of type "
                                  f"{' or '.join(t.__name__ for t in _types(types))}.", param=where.split(".")[0])
        if kind == "text" and not block["text"]:  # Anthropic's API refuses it; vLLM drops it
            raise bad_request(f"{where}.{j}.text: must not be empty.", param=where.split(".")[0])
        if kind == "tool_result" and isinstance(block.get("content"), list):
            _check_blocks(block["content"], f"{where}.{j}.content", kinds=TOOL_RESULT_TYPES)


def _types(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def chat_messages(req: InferenceRequest, merge_inline_system: bool) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for this Messages request (raises :class:`NotRenderable`)."""
    if req.thinking is not None or req.output_config is not None:
        raise NotRenderable("thinking or output_config changes the template's arguments")
    out: list[dict[str, Any]] = []
    system = _system_parts(req.system)
    if merge_inline_system:
        for msg in req.messages or ():
            if msg.get("role") == "system" and (text := _system_text(msg.get("content"))):
                system.append(text)
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for msg in req.messages or ():
        _convert_message(msg, out, merge_inline_system)
    return out


def chat_tools(req: InferenceRequest) -> list[dict[str, Any]] | None:
    choice = req.tool_choice
    if not req.tools or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                              "parameters": t.get("input_schema")}}
            for t in req.tools]


def _system_parts(system: Any) -> list[str]:
    if isinstance(system, str):
        return [system] if system else []
    return [b["text"] for b in system or () if isinstance(b, dict) and b.get("type") == "text" and b.get("text")
            and not b["text"].startswith(BILLING_HEADER)]


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = _system_parts(content)
    return "".join(parts) if parts else None


def _convert_message(msg: dict[str, Any], out: list[dict[str, Any]], merge_inline_system: bool) -> None:
    role, content = msg.get("role"), msg.get("content")
    if role == "system":
        if not merge_inline_system and (text := _system_text(content)):
            out.append({"role": "system", "content": text})
        return
    converted: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        converted["content"] = content
    else:
        _convert_blocks(content or [], role, converted, out)
    if not (role == "user" and "content" not in converted):
        out.append(converted)


def _convert_blocks(blocks: list[Any], role: str | None, converted: dict[str, Any],
                    out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            tool_calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            _convert_tool_result(block, role, parts, out)
        elif kind in ("image", "document"):
            raise NotRenderable(f"{kind} blocks")
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if len(parts) == 1:
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _convert_tool_result(block: dict[str, Any], role: str | None, parts: list[dict[str, Any]],
                         out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    if role != "user":
        parts.append({"type": "text", "text": f"Tool result: {content if content else ''}"})
        return
    if isinstance(content, list):
        if any(isinstance(i, dict) and i.get("type") not in ("text",) for i in content):
            raise NotRenderable("a tool result with images or tool references")
        content = "\n".join(i.get("text", "") for i in content if isinstance(i, dict))
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                "content": content if isinstance(content, str) else ""})
