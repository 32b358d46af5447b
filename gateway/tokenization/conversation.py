"""A request's conversation in one shape, for every part that reads it: the tokenizers (the chat
template sees what vLLM's would) and the approximate prefix index (a canonical text of the prompt).

Chat requests carry ``messages``; Responses requests carry ``instructions`` and ``input`` items
(:mod:`gateway.tokenization.openai_responses`); Anthropic Messages requests carry ``system`` and content blocks
(:mod:`gateway.tokenization.anthropic`); content is a string or a list of parts, of which only text parts
(``text``, and the Responses API's ``input_text`` and ``output_text``) are flattened, joined by newlines as
vLLM joins them for a template that takes string content.
"""

from __future__ import annotations

from typing import Any

from gateway.core.inference_api import InferenceRequest, RequestKind
from gateway.tokenization import anthropic, openai_responses

CHAT_KINDS = frozenset(k for k in RequestKind if k.conversational)


TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def text_of_content(content: Any) -> str | None:
    """A message's content as one string: text parts joined by newlines, as vLLM hands them to a
    string-content chat template (None when some part is not text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    return None


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with all-text content lists flattened to strings, and no content (an assistant's tool
    calls alone) as the empty string vLLM gives a string-content template (others left as they are)."""
    out = []
    for message in messages:
        content = message.get("content")
        if content is None and message.get("role") == "assistant":
            message = {**message, "content": ""}
        elif isinstance(content, list) and (text := text_of_content(content)) is not None:
            message = {**message, "content": text}
        out.append(message)
    return out


def chat_messages(kind: RequestKind, req: InferenceRequest, merge_inline_system: bool = False
                  ) -> list[dict[str, Any]] | None:
    """The conversation of a chat, Responses or Messages request (None for other kinds, or when empty).
    ``merge_inline_system``: the chat template takes a system message only first (Messages requests);
    raises :class:`~gateway.tokenization.anthropic.NotRenderable` for what cannot be rendered exactly."""
    if kind == RequestKind.CHAT:
        return req.messages
    if kind == RequestKind.MESSAGES:
        return anthropic.chat_messages(req, merge_inline_system) or None
    if kind != RequestKind.RESPONSES:
        return None
    return normalize_messages(openai_responses.chat_messages(req.instructions, req.input)) or None


def chat_tools(kind: RequestKind, req: InferenceRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template renders (Messages and Responses requests' converted to chat's form)."""
    if kind == RequestKind.MESSAGES:
        return anthropic.chat_tools(req)
    if kind == RequestKind.RESPONSES:
        return openai_responses.chat_tools(req.tools, req.tool_choice)
    return req.tools


def request_text(kind: RequestKind, req: InferenceRequest) -> str:
    """A canonical text of the prompt: roles and contents in order (what a chat template would see), or
    a completion's first prompt."""
    try:
        messages = chat_messages(kind, req)
    except anthropic.NotRenderable:
        messages = [m for m in req.messages or () if isinstance(m, dict)]
    if messages:
        return "".join(f"\x1e{m.get('role', '')}\x1f{text_of_content(m.get('content')) or ''}" for m in messages)
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return ""
