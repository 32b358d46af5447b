"""The ``usage`` object of an answer, read from a whole body or from the tail of an SSE stream.

OpenAI's names (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) are
the gateway's; Anthropic's (``input_tokens`` not cached, ``cache_read_input_tokens``, ``output_tokens``)
and the Responses API's (``input_tokens`` all of them, ``input_tokens_details.cached_tokens``) are read into
them. A Responses stream carries its usage in the ``response`` of its last event.
"""

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
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    input_tokens_details: PromptTokensDetails | None = None  # the Responses API's

    def __post_init__(self) -> None:
        if self.input_tokens is None:
            return
        self.completion_tokens = self.output_tokens or 0
        if self.input_tokens_details is not None:  # Responses: input_tokens counts the cached ones
            self.prompt_tokens = self.input_tokens
            self.prompt_tokens_details = self.input_tokens_details
            return
        cached = self.cache_read_input_tokens
        self.prompt_tokens = self.input_tokens + (cached or 0) + (self.cache_creation_input_tokens or 0)
        if cached is not None:
            self.prompt_tokens_details = PromptTokensDetails(cached)

    @property
    def cached_tokens(self) -> int | None:
        details = self.prompt_tokens_details
        return details.cached_tokens if details is not None else None


class _Usage(msgspec.Struct):
    usage: Usage | None = None


class _UsageCarrier(_Usage):
    response: _Usage | None = None  # a Responses stream's last event: the whole response


_usage_decoder = msgspec.json.Decoder(_UsageCarrier)


def usage_of_body(body: bytes) -> Usage | None:
    try:
        carrier = _usage_decoder.decode(body)
    except msgspec.MsgspecError:
        return None
    return carrier.usage or (carrier.response.usage if carrier.response is not None else None)


def usage_of_stream_tail(chunks: deque[bytes]) -> Usage | None:
    """The usage of a finished SSE stream: it rides in the last ``data:`` event that has one (after an
    ``event:`` line in Anthropic's streams)."""
    tail = b"".join(chunks)
    for event in reversed(tail.split(b"\n\n")):
        data = event.strip().rpartition(b"\n")[2]
        if data.startswith(b"data: {") and b'"usage"' in data:
            return usage_of_body(data[6:])
    return None


def usage_of_json_tail(tail: bytes) -> Usage | None:
    """The usage of a JSON answer from its last bytes alone: the object after its last ``"usage":`` key
    (engines write it near the end of the body)."""
    at = tail.rfind(b'"usage":')
    if at < 0:
        return None
    start = tail.find(b"{", at)
    if start < 0 or tail[at + 8:start].strip():
        return None  # "usage": null
    depth = 0
    for end in range(start, len(tail)):
        byte = tail[end]
        if byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                try:
                    return _usage_only.decode(tail[start:end + 1])
                except msgspec.MsgspecError:
                    return None
    return None


_usage_only = msgspec.json.Decoder(Usage)
