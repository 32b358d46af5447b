"""What the gateway refuses before any pod sees it: a body its API does not allow, or a header of the
gateway's own with a value it cannot mean.

Each refusal is a 400 that names the field (``param``, and the message's first words: Anthropic's error
shape has no ``param``) or the header. The checks follow the APIs' own definitions where the engines are
laxer or answer with their own error shapes (vLLM's ``'int' object is not iterable``):

- chat: ``messages``, a non-empty list of objects with a known ``role`` and a string or a list of parts
  as ``content`` (an assistant's may be absent: tool calls alone);
- completions: ``prompt``, a string, token ids, or a non-empty list of either; embeddings: ``input``, the same;
- responses: ``input``, a string or a list of items: messages (a ``role`` and content) and the items vLLM
  renders with the fields it reads (``function_call``: ``call_id``, ``name``, ``arguments``; its output:
  ``call_id``, ``output``; ``reasoning``: ``summary``); other types pass, for the pod to judge;
- Messages (Anthropic): :func:`gateway.tokenization.anthropic.check_request`;
- every API: ``n`` in 1..128, ``temperature`` in 0..2 (Anthropic's 0..1), ``top_p`` in 0..1 (token
  counts and types are the parser's: :func:`gateway.core.requests.parse_inference_request`);
- headers (:data:`HEADERS`): ``x-priority`` an integer within ±:data:`MAX_PRIORITY` (a flow band lives as long
  as requests use it), ``x-workflow-complete`` true or false, SLO targets positive numbers, cache policies
  and thresholds, and identifiers (request, workflow, stage, session, agent) of printable characters and
  bounded length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gateway.auth import ApiKeyAuth
from gateway.backends.registry import PodRegistry
from gateway.config import ServerConfig
from gateway.core.errors import bad_request, unknown_model
from gateway.core.requests import InferenceRequest, RequestKind
from gateway.flow.flows import FAIRNESS_HEADER, MAX_FAIRNESS_ID_CHARS, OBJECTIVE_HEADER, PRIORITY_HEADER
from gateway.request.types import ClientRequest
from gateway.tokenization import anthropic
from gateway.workflow.context import AGENT_HEADERS, SESSION_SIGNALS, STAGE_HEADERS, WORKFLOW_HEADERS

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
RESPONSES_ROLES = frozenset({"system", "developer", "user", "assistant"})
# A flow band lives as long as requests use it: a bounded range keeps a typo from making a permanent one.
MAX_PRIORITY = 1000
MAX_ID_CHARS = 256
MAX_N = 128


class RequestValidation:
    """resolve (first): refuse what no pod should see (a body its API does not allow, a header the gateway
    cannot mean, too many messages, a model the key may not use or no pod serves), before anything reads
    the request."""

    def __init__(self, pods: PodRegistry, key_auth: ApiKeyAuth, server: ServerConfig,
                 is_public: Callable[[str], bool] = lambda model: False) -> None:
        self._pods = pods
        # A model rule's public name: its targets are the router's to find (none with a pod: the next
        # target, or a 503), so no pod need list it.
        self._is_public = is_public
        self._key_auth = key_auth
        self._max_messages = server.max_messages

    def resolve(self, request: ClientRequest) -> None:
        check_headers(request.headers)
        self._key_auth.authorize(request.key, request.model)
        if not self._is_public(request.model) and not self._pods.knows_model(request.model):
            raise unknown_model(request.model)
        check_body(request.kind, request.parsed)
        messages = request.parsed.messages
        if messages is not None and len(messages) > self._max_messages:
            raise bad_request(f"messages: too many ({len(messages)}, at most {self._max_messages}).",
                              param="messages", code="too_many_messages")


def check_body(kind: RequestKind, req: InferenceRequest) -> None:
    """Refuse (400, naming the field) a body the request's API does not allow."""
    if RequestKind(kind).anthropic:
        anthropic.check_request(req, counting=kind == RequestKind.COUNT_TOKENS)
    elif kind == RequestKind.CHAT:
        _check_messages(req.messages)
    elif kind == RequestKind.COMPLETIONS:
        _check_prompt(req.prompt, "prompt")
    elif kind == RequestKind.EMBEDDINGS:
        _check_prompt(req.input, "input")
    elif kind == RequestKind.RESPONSES:
        _check_input(req.input)
    _range("n", req.n, 1, MAX_N)
    _range("temperature", req.temperature, 0, 1 if kind == RequestKind.MESSAGES else 2)
    _range("top_p", req.top_p, 0, 1)


def _range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not (low <= value <= high):
        raise bad_request(f"{name}: must be between {low} and {high}, got {value}.", param=name)


def _check_messages(messages: list[dict[str, Any]] | None) -> None:
    if not messages:
        raise bad_request("messages: at least one message is required.", param="messages")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise bad_request(f"{where}: must be an object.", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role: must be one of {', '.join(sorted(CHAT_ROLES))}.",
                              param=f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":
            continue
        _check_content(content, f"{where}.content")


def _check_content(content: Any, where: str) -> None:
    """A string, or a non-empty list of parts, each an object with a string ``type``."""
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise bad_request(f"{where}: must be a string or a non-empty list of content parts.", param=where)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{where}.{j}: must be an object with a string `type`.", param=f"{where}.{j}")


def _check_prompt(prompt: Any, name: str) -> None:
    """A string, token ids, or a non-empty list of strings or of token-id lists."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if _token_ids(prompt) or all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
            return
    raise bad_request(f"{name}: must be a string, a list of token ids, or a non-empty list of either.",
                      param=name)


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _check_input(items: Any) -> None:
    if isinstance(items, str):
        return
    if not isinstance(items, list):
        raise bad_request("input: must be a string or a list of input items.", param="input")
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an object.", param=where)
        role, kind = item.get("role"), item.get("type")
        if role is not None:
            if role not in RESPONSES_ROLES:
                raise bad_request(f"{where}.role: must be one of {', '.join(sorted(RESPONSES_ROLES))}.",
                                  param=f"{where}.role")
            _check_content(item.get("content"), f"{where}.content")
        elif not isinstance(kind, str):
            raise bad_request(f"{where}: must have a `role` or a string `type`.", param=where)
        else:
            for name, types in _ITEM_FIELDS.get(kind, {}).items():
                if not isinstance(item.get(name), types):
                    raise bad_request(f"{where}.{name}: required for a {kind} item, of type "
                                      f"{' or '.join(t.__name__ for t in types)}.", param=f"{where}.{name}")


# The fields of the input items vLLM renders, as the Responses API defines them.
_ITEM_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "function_call": {"call_id": (str,), "name": (str,), "arguments": (str,)},
    "function_call_output": {"call_id": (str,), "output": (str, list)},
    "custom_tool_call": {"call_id": (str,), "name": (str,), "input": (str,)},
    "custom_tool_call_output": {"call_id": (str,), "output": (str, list)},
    "reasoning": {"summary": (list,)},
}


def _integer(low: int, high: int) -> Callable[[str], bool]:
    def check(value: str) -> bool:
        try:
            return low <= int(value) <= high
        except ValueError:
            return False

    return check


def _positive_number(value: str) -> bool:
    try:
        number = float(value)
    except ValueError:
        return False
    return math.isfinite(number) and number > 0


def _one_of(*choices: str) -> Callable[[str], bool]:
    return lambda value: value.strip().lower() in choices


def _identifier(limit: int) -> Callable[[str], bool]:
    return lambda value: len(value) <= limit and value.isprintable()


_IDENTIFIERS = {"x-request-id", *WORKFLOW_HEADERS, *STAGE_HEADERS, *AGENT_HEADERS,
                *(s.name for s in SESSION_SIGNALS if s.where == "header" and s.name.startswith("x-"))}
# Each ``x-`` header the gateway reads on the request path: what its value must be, how to say so, and the
# error's code.
HEADERS: dict[str, tuple[Callable[[str], bool], str, str]] = {
    PRIORITY_HEADER: (_integer(-MAX_PRIORITY, MAX_PRIORITY), f"an integer from {-MAX_PRIORITY} to {MAX_PRIORITY}",
                      "invalid_slo_header"),
    "x-slo-ttft-ms": (_positive_number, "a positive number of milliseconds", "invalid_slo_header"),
    "x-slo-e2e-ms": (_positive_number, "a positive number of milliseconds", "invalid_slo_header"),
    FAIRNESS_HEADER: (lambda v: 0 < len(v.strip()) <= MAX_FAIRNESS_ID_CHARS and v.isprintable(),
                      f"1 to {MAX_FAIRNESS_ID_CHARS} printable characters", "invalid_fairness_id"),
    OBJECTIVE_HEADER: (_identifier(MAX_FAIRNESS_ID_CHARS), f"at most {MAX_FAIRNESS_ID_CHARS} printable characters",
                       "invalid_header"),
    "x-workflow-complete": (_one_of("true", "false"), "true or false", "invalid_header"),
    "x-stage-cache-policy": (_one_of("auto", "preserve", "flush"), "auto, preserve or flush", "invalid_header"),
    "x-stage-preserve-threshold": (_integer(0, 2**62), "a number of tokens", "invalid_header"),
    **{name: (_identifier(MAX_ID_CHARS), f"at most {MAX_ID_CHARS} printable characters", "invalid_header")
       for name in sorted(_IDENTIFIERS)},
}


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse (400, naming the header) a value of a gateway header it cannot mean."""
    for name, (valid, expected, code) in HEADERS.items():
        value = headers.get(name)
        if value is not None and not valid(value):
            raise bad_request(f"{name}: must be {expected}, got {value[:40]!r}.", param=name, code=code)
