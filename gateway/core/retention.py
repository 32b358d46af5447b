"""Declared retention: how long a client says it will reuse its prompt's prefix.

- Anthropic Messages: ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` breakpoints on the
  system blocks, the tools and the messages' content blocks (no ``ttl``: five minutes). Claude Code sends
  them on every turn.
- OpenAI: ``prompt_cache_retention: "in_memory" | "24h"`` (``in_memory`` kept for five minutes of
  inactivity, as the API's in-memory policy keeps its caches at least that long).

The gateway reads the longest retention a request declares and keeps the context it leaves resumable at
least that long (:mod:`gateway.kv.working_set`): placement counts it, keep-warm may refresh it, and no
hard flush empties its pod meanwhile. The body reaches the engine as the client sent it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gateway.core.errors import bad_request
from gateway.core.inference_api import InferenceRequest

CACHE_CONTROL_TTL_S = {"5m": 300.0, "1h": 3600.0}
DEFAULT_CACHE_CONTROL_TTL = "5m"
PROMPT_CACHE_RETENTION_S = {"in_memory": 300.0, "in-memory": 300.0, "24h": 86_400.0}


def declared_retention_s(request: InferenceRequest) -> float | None:
    """The longest retention the request declares, in seconds (None: it declares none). A value the APIs
    do not define is a 400, as they answer it."""
    declared: list[float] = []
    if request.prompt_cache_retention is not None:
        retention = PROMPT_CACHE_RETENTION_S.get(request.prompt_cache_retention)
        if retention is None:
            raise bad_request(f"prompt_cache_retention must be 'in_memory' or '24h', got "
                              f"{request.prompt_cache_retention!r}.", param="prompt_cache_retention")
        declared.append(retention)
    for where, control in _cache_controls(request):
        ttl = control.get("ttl", DEFAULT_CACHE_CONTROL_TTL) if isinstance(control, dict) else None
        if ttl not in CACHE_CONTROL_TTL_S:
            raise bad_request(f"{where}.cache_control.ttl must be '5m' or '1h', got {ttl!r}.",
                              param=f"{where}.cache_control")
        declared.append(CACHE_CONTROL_TTL_S[ttl])
    return max(declared, default=None)


def _cache_controls(request: InferenceRequest) -> Iterator[tuple[str, Any]]:
    """Each ``cache_control`` breakpoint of the request, with where it is (for an error's ``param``)."""
    for name, blocks in (("system", request.system), ("tools", request.tools)):
        if isinstance(blocks, list):
            for i, block in enumerate(blocks):
                if isinstance(block, dict) and block.get("cache_control") is not None:
                    yield f"{name}[{i}]", block["cache_control"]
    for i, message in enumerate(request.messages or ()):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for j, block in enumerate(content):
                if isinstance(block, dict) and block.get("cache_control") is not None:
                    yield f"messages[{i}].content[{j}]", block["cache_control"]
