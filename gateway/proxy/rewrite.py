"""A request's ``model`` rewritten for the pod, and the answer's restored for the client.

A public model name (``gateway/models/rules.py``) is served by a target the pods know: the body sent
upstream names the target, and the answer (a whole body, or every SSE event of a stream) names the public
name again, byte for byte otherwise.

Both sides replace one JSON member in place rather than decode and re-encode the body:

- the request: the top-level ``"model": "<public>"`` member: the body's first member (SDKs write it first),
  or the one ``"model"`` key the body holds (the top-level one, which parsing found); otherwise (a nested
  ``model`` key, an escaped key) the body is decoded, changed and encoded again;
- the answer: every ``"model": "<target>"`` member. An unescaped quote cannot occur inside a JSON string,
  so the pattern only ever matches a member: the answer's own (``choices`` chunks, the Anthropic
  ``message_start``, the Responses ``response`` object). Engines write it compactly (``"model":"x"``), which
  a plain byte replacement finds; other spacing goes through the pattern. A stream is rewritten event by
  event: an event that arrives cut in two is held until its end (a client reads whole events anyway).
"""

from __future__ import annotations

import re
from functools import lru_cache

import msgspec
import orjson

_EVENT_END = b"\n\n"
_MODEL_KEY = b'"model"'
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]+)"')


@lru_cache(maxsize=256)
def _member(name: str) -> re.Pattern[bytes]:
    """``"model": "<name>"`` with any whitespace JSON allows around the colon."""
    return re.compile(rb'("model"\s*:\s*)' + re.escape(orjson.dumps(name)))


@lru_cache(maxsize=256)
def _first_member(name: str) -> re.Pattern[bytes]:
    """The same as the object's first member: necessarily the top-level one."""
    return re.compile(rb'\s*\{\s*("model"\s*:\s*)' + re.escape(orjson.dumps(name)))


def with_model(body: bytes, public: str, target: str) -> bytes:
    """The request body naming ``target`` where it named ``public``."""
    if (first := _first_member(public).match(body)) is not None:
        return body[:first.end(1)] + orjson.dumps(target) + body[first.end():]
    if body.count(_MODEL_KEY) == 1:
        rewritten, found = _member(public).subn(rb"\g<1>" + _escaped(target), body, count=1)
        if found:
            return rewritten
    decoded = msgspec.json.decode(body)  # numbers kept exact, big integers included
    decoded["model"] = target
    return msgspec.json.encode(decoded)


def _escaped(name: str) -> bytes:
    return orjson.dumps(name).replace(b"\\", b"\\\\")  # a replacement template's own escapes


class AnswerRewrite:
    """One answer's way back: the ``model`` the pod wrote (``served``) becomes ``shown``, and (with
    ``capture_response_id``) the Responses answer's id is kept in ``response_id``."""

    __slots__ = ("_capture", "_compact", "_compact_shown", "_held", "_member", "_shown", "response_id")

    def __init__(self, served: str, shown: str, capture_response_id: bool = False) -> None:
        self._member = _member(served) if served != shown else None
        self._shown = rb"\g<1>" + _escaped(shown)
        self._compact = _MODEL_KEY + b":" + orjson.dumps(served)
        self._compact_shown = _MODEL_KEY + b":" + orjson.dumps(shown)
        self._capture = capture_response_id
        self._held = b""
        self.response_id: str | None = None

    def body(self, data: bytes) -> bytes:
        """A whole answer."""
        return self._rewritten(data)

    def chunk(self, data: bytes) -> bytes:
        """A piece of a stream: the whole events it completes, rewritten (possibly nothing yet)."""
        if self._held:
            data = self._held + data
            self._held = b""
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._held = data
            return b""
        end += len(_EVENT_END)
        if end < len(data):
            data, self._held = data[:end], data[end:]
        return self._rewritten(data)

    def rest(self) -> bytes:
        """What a stream left unfinished when it ended, passed on as it came."""
        held, self._held = self._held, b""
        return self._rewritten(held) if held else b""

    def _rewritten(self, data: bytes) -> bytes:
        if self._capture and self.response_id is None and (found := _RESPONSE_ID.search(data)):
            self.response_id = found.group(1).decode()
        if self._member is None:
            return data
        members = data.count(_MODEL_KEY)
        if not members:
            return data
        if data.count(self._compact) == members:  # every one written as engines write it
            return data.replace(self._compact, self._compact_shown)
        return self._member.sub(self._shown, data)
