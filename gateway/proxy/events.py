"""A pod's SSE stream checked event by event as it is relayed: an engine's own error event, and an event whose
data is not JSON.

An engine that fails mid-answer writes its error inside the 200 stream (vLLM: ``data: {"error": {...}}``;
Anthropic's API: ``event: error`` with ``{"type": "error", ...}``): the client reads it, so it is passed on,
but the request failed and the pod is to blame. An event whose ``data`` is not JSON (``[DONE]`` aside) is
never passed on: an SDK decoding it raises a JSON error instead of the API's own. To hold that line, only
whole events are let through (one cut in two waits for its end), as a client reads them anyway.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

_DONE = b"[DONE]"
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
# Either end, leftmost first (one cannot start inside the other): one pass over a chunk of many events.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n")


class _Event(msgspec.Struct):
    """What tells an error event apart (every other member is skipped, but still checked to be JSON)."""

    error: Any = None
    type: Any = None


_decoder = msgspec.json.Decoder(_Event)


class EventCheck:
    """One stream's events, checked in order: :meth:`chunk` returns what of each piece read may go to the client;
    ``engine_error`` says an error event passed, ``malformed`` that one was held back (and the stream is to end:
    nothing from that event on is returned)."""

    __slots__ = ("_held", "engine_error", "malformed")

    def __init__(self) -> None:
        self._held = b""
        self.engine_error = False
        self.malformed = False

    def chunk(self, data: bytes) -> bytes:
        """The whole events ``data`` completes (possibly nothing yet), up to a malformed one."""
        if self._held:
            data = self._held + data
            self._held = b""
        end = max(data.rfind(sep) + len(sep) if sep in data else 0 for sep in _EVENT_ENDS)
        if end < len(data):
            data, self._held = data[:end], data[end:]
        return self._checked(data)

    def rest(self) -> bytes:
        """What the stream left unfinished when it ended, checked as a last event."""
        held, self._held = self._held, b""
        return self._checked(held)

    def _checked(self, data: bytes) -> bytes:
        # One bare event, as engines mostly write them: no need to look for more.
        events = [data] if _bare_data(data) else _events(data)
        good = 0
        for event in events:
            error = _error(*_fields(event))
            if error is None:
                self.malformed = True
                return data[:good]
            self.engine_error = self.engine_error or error
            good += len(event)
        return data


def _events(data: bytes) -> list[bytes]:
    """Each event with its separator (so their lengths add up to ``data``'s)."""
    events, start = [], 0
    for end in _EVENT_END.finditer(data):
        events.append(data[start:end.end()])
        start = end.end()
    if start < len(data):
        events.append(data[start:])
    return events


def _bare_data(event: bytes) -> bool:
    """Whether ``event`` is one ``data:`` line and its blank line, as engines write their events."""
    return event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2


def _fields(event: bytes) -> tuple[bytes | None, bytes | None]:
    """An event's name and its data (its ``data:`` lines joined, as SSE defines; None: it has none)."""
    if _bare_data(event):
        return None, event[6:-2]
    name, data = None, []
    for line in event.splitlines():
        field, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value
    return name, b"\n".join(data) if data else None


def _error(name: bytes | None, data: bytes | None) -> bool | None:
    """Whether an event is an engine's error (None: its data is not JSON)."""
    if name == b"error":
        return True
    if data is None or data == _DONE:
        return False
    try:
        event = _decoder.decode(data)
    except msgspec.ValidationError:  # JSON, just not an object: nothing an engine writes as an error
        return False
    except msgspec.DecodeError:
        return None
    return event.error is not None or event.type == "error"
