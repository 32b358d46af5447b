"""A pod's error answer, in the route's own shape.

Engines answer errors in shapes of their own: vLLM's ``{"error": {"message", "type": "BadRequestError",
"param", "code": 400}}`` (an integer code, a Python class as the type), FastAPI's ``{"detail": ...}`` for a
path it does not serve, Anthropic's ``{"type": "error", "error": {...}}``, or plain text. The client gets
the same status and the pod's text as the message, in OpenAI's shape (a standard ``type``, a string
``code`` or none, the pod's ``param``) or, on the Anthropic route, Anthropic's. A path the pod does not
serve at all (404 or 405 without an API error body) is said to be that: an endpoint the model's pods do
not implement (501).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.http_errors import HttpError, openai_error_type

MAX_MESSAGE_CHARS = 2000


def translated(status: int, body: bytes, path: str) -> HttpError:
    """The error the client gets for a pod's ``status`` answer with ``body``, sent to ``path``."""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):  # OpenAI's, vLLM's, Anthropic's
        code, param = error.get("code"), error.get("param")
        return HttpError(status, _bounded(error["message"]), openai_error_type(status),
                         code if isinstance(code, str) else None, param if isinstance(param, str) else None)
    if status in (404, 405):
        endpoint = path.split("?", 1)[0]
        return HttpError(501, f"The pods serving this model do not implement {endpoint} (they answered {status}).",
                         "invalid_request_error", "unsupported_endpoint")
    detail = data.get("detail") if isinstance(data, dict) else None
    text = detail if isinstance(detail, str) else body.decode(errors="replace").strip()
    return HttpError(status, _bounded(text) or f"The pod answered HTTP {status}.", openai_error_type(status))


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."
