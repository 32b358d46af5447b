"""The ``usage`` object of an OpenAI answer, read from a whole body or from the tail of an SSE stream."""

from __future__ import annotations

from collections import deque

import msgspec


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # vLLM with --enable-prompt-tokens-details, SGLang: how many prompt tokens the engine found cached.
    prompt_tokens_details: PromptTokensDetails | None = None

    @property
    def cached_tokens(self) -> int | None:
        details = self.prompt_tokens_details
        return details.cached_tokens if details is not None else None


class _UsageCarrier(msgspec.Struct):
    usage: Usage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageCarrier)


def usage_of_body(body: bytes) -> Usage | None:
    try:
        return _usage_decoder.decode(body).usage
    except msgspec.MsgspecError:
        return None


def usage_of_stream_tail(chunks: deque[bytes]) -> Usage | None:
    """The usage of a finished SSE stream: it rides in the last ``data:`` event that has one."""
    tail = b"".join(chunks)
    for event in reversed(tail.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data: {") and b'"usage"' in event:
            return usage_of_body(event[6:])
    return None
