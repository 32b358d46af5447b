"""What the gateway refuses before any pod sees it: a body its API does not allow, or a header of the
gateway's own with a value it cannot mean.

Each refusal is a 400 that names the field (``param``, and the message's first words: Anthropic's error
shape has no ``param``) or the header. The checks follow the APIs' own definitions where the engines are
laxer or answer with their own error shapes (vLLM's ``'int' object is not iterable``):

- the body's ``content-type``: JSON (``application/json``, or a ``+json`` type), or none declared (no header,
  or ``application/octet-stream``: what HTTP libraries send for bytes given without a type); the body goes
  on to the pod as ``application/json`` (vLLM takes no other);
- chat: ``messages``, a non-empty list of objects with a known ``role`` (a string) and a string or a list of
  parts as ``content`` (an assistant's may be absent: tool calls alone), each part of a type the OpenAI API
  or vLLM's chat parser defines (:data:`CHAT_PART_TYPES`);
- completions: ``prompt``, a string, token ids, or a non-empty list of either; embeddings: ``input``, the same;
- responses: ``instructions`` a string; ``input``, a string or a list of items (none only after instructions
  or a previous response), each of a type the Responses API defines
  (:data:`RESPONSES_ITEM_TYPES`): messages (a ``role`` and content, parts of :data:`RESPONSES_PART_TYPES`)
  and the items vLLM renders with the fields it reads (``function_call``: ``call_id``, ``name``,
  ``arguments``; its output: ``call_id``, ``output``; ``reasoning``: ``summary``);
- Messages (Anthropic): :func:`gateway.tokenization.anthropic.check_request`;
- every API: ``n`` in 1..128, ``temperature`` in 0..2 (Anthropic's 0..1), ``top_p`` in 0..1; the OpenAI
  APIs: ``presence_penalty`` and ``frequency_penalty`` in -2..2, ``seed`` a 64-bit integer (token counts
  and types are the parser's: :func:`gateway.core.inference_api.parse_inference_request`, where an integer
  field takes no number with a fraction part, ``8.0`` included, as the OpenAI API's does: vLLM's takes
  ``8.0``);
- the answer's length (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``) against the model's
  context, once a target is known (:func:`check_output_tokens`, from
  :class:`~gateway.request.steps.PromptTokenization`): with the prompt, when it is counted, as vLLM
  refuses it;
- headers (:data:`HEADERS`): ``x-priority`` an integer within ±:data:`MAX_PRIORITY` (a flow band lives as long
  as requests use it), ``x-workflow-complete`` true or false, SLO targets positive numbers, cache policies
  and thresholds, and identifiers (request, workflow, stage, session, agent) of printable characters and
  bounded length.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.auth import ApiKeyAuth
from gateway.config import ServerConfig
from gateway.core.errors import bad_request, no_pod_available, unknown_model
from gateway.core.inference_api import InferenceRequest, RequestKind
from gateway.flow.flows import FAIRNESS_HEADER, MAX_FAIRNESS_ID_CHARS, OBJECTIVE_HEADER, PRIORITY_HEADER
from gateway.pods.registry import PodRegistry
from gateway.request.types import ClientRequest
from gateway.tokenization import anthropic
from gateway.workflow.context import AGENT_HEADERS, SESSION_SIGNALS, STAGE_HEADERS, WORKFLOW_HEADERS

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
RESPONSES_ROLES = frozenset({"system", "developer", "user", "assistant"})
# The content parts vLLM's chat parser reads (``MM_PARSER_MAP`` of vllm/entrypoints/chat_utils.py); it
# refuses any other type ("Unknown part type") or, for the API's own, drops it unread. Chat messages and
# Responses messages both go through it.
_VLLM_PART_TYPES = frozenset({
    "text", "input_text", "output_text", "thinking", "refusal", "image_url", "input_image", "image_embeds",
    "image_pil", "audio_url", "input_audio", "audio_embeds", "video_url", "video_embeds", "prompt_embeds",
    "tool_reference"})
# The content parts of a chat message: the OpenAI API's, and vLLM's.
CHAT_PART_TYPES = _VLLM_PART_TYPES | {"file"}
# The content parts of a Responses message: the Responses API's (input and output messages), and vLLM's.
RESPONSES_PART_TYPES = _VLLM_PART_TYPES | {"input_file"}
# The input items of the Responses API (the union ``ResponseInputItemParam`` of OpenAI's SDK).
RESPONSES_ITEM_TYPES = frozenset({
    "message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
    "reasoning", "item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "code_interpreter_call", "image_generation_call", "local_shell_call", "local_shell_call_output", "shell_call",
    "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output", "compaction",
    "compaction_trigger", "additional_tools", "configuration_update", "program", "program_output"})
# A flow band lives as long as requests use it: a bounded range keeps a typo from making a permanent one.
MAX_PRIORITY = 1000
MAX_ID_CHARS = 256
MAX_N = 128
# vLLM's range for ``seed`` (a C long).
MAX_SEED = 2**63 - 1


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

    def resolve(self, request: ClientRequest) -> Awaitable[ClientRequest] | None:
        check_headers(request.headers)
        self._key_auth.authorize(request.key, request.model)
        if not self._knows(request.model):
            if self._pods.models_pending():  # a pod that has not said what it serves may serve it
                return self._once_pods_answered(request)
            raise unknown_model(request.model)
        self._check_body(request)
        return None

    def _knows(self, model: str) -> bool:
        return self._is_public(model) or self._pods.knows_model(model)

    async def _once_pods_answered(self, request: ClientRequest) -> ClientRequest:
        """Just after start, the pods' first answers; then the model is known, or unknown, or (a pod still
        silent) a 503 to retry."""
        await self._pods.first_answers()
        if not self._knows(request.model):
            if self._pods.models_pending():
                raise no_pod_available(request.model, self._pods.back_in_s(request.model))
            raise unknown_model(request.model)
        self._check_body(request)
        return request

    def _check_body(self, request: ClientRequest) -> None:
        check_body(request.kind, request.parsed)
        messages = request.parsed.messages
        if messages is not None and len(messages) > self._max_messages:
            raise bad_request(f"messages: too many ({len(messages)}, at most {self._max_messages}).",
                              param="messages", code="too_many_messages")


def check_body(kind: RequestKind, req: InferenceRequest) -> None:
    """Refuse (400, naming the field) a body the request's API does not allow."""
    if RequestKind(kind).anthropic:
        anthropic.check_request(req, counting=kind == RequestKind.COUNT_TOKENS)
    else:
        if kind == RequestKind.CHAT:
            _check_messages(req.messages)
        elif kind == RequestKind.COMPLETIONS:
            _check_prompt(req.prompt, "prompt")
        elif kind == RequestKind.EMBEDDINGS:
            _check_prompt(req.input, "input")
        elif kind == RequestKind.RESPONSES:
            if req.instructions is not None and not isinstance(req.instructions, str):
                raise bad_request("instructions: must be a string.", param="instructions")
            # Instructions or an earlier response make a turn of their own: the input may be empty then.
            _check_input(req.input, bool(req.instructions) or req.previous_response_id is not None)
        _range("presence_penalty", req.presence_penalty, -2, 2)
        _range("frequency_penalty", req.frequency_penalty, -2, 2)
        _range("seed", req.seed, -MAX_SEED - 1, MAX_SEED)
    _range("n", req.n, 1, MAX_N)
    _range("temperature", req.temperature, 0, 1 if kind == RequestKind.MESSAGES else 2)
    _range("top_p", req.top_p, 0, 1)


# The fields that bound an answer's length on each API that answers with text, first the one the engine
# reads first (vLLM's chat takes ``max_completion_tokens`` over ``max_tokens``).
_OUTPUT_FIELDS: dict[RequestKind, tuple[str, ...]] = {
    RequestKind.CHAT: ("max_completion_tokens", "max_tokens"), RequestKind.COMPLETIONS: ("max_tokens",),
    RequestKind.RESPONSES: ("max_output_tokens",), RequestKind.MESSAGES: ("max_tokens",),
}


def output_tokens(kind: RequestKind, req: InferenceRequest) -> tuple[str, int] | None:
    """The field that bounds the answer's length as the engine reads it, and its value; None when the
    request sets none or answers no text."""
    for name in _OUTPUT_FIELDS.get(kind, ()):
        if (value := getattr(req, name)) is not None:
            return name, value
    return None


def check_output_tokens(kind: RequestKind, req: InferenceRequest, context: int | None,
                        prompt_tokens: int | None = None) -> None:
    """Refuse (400, naming the field) an answer longer than the model's ``context`` leaves room for beside
    the prompt (``prompt_tokens`` when counted, else at least one: vLLM refuses an empty prompt), as vLLM
    refuses it: ``prompt + max_tokens > max_model_len``."""
    bound = output_tokens(kind, req)
    if bound is None or context is None:
        return
    name, value = bound
    prompt = prompt_tokens or 1
    if prompt + value > context:
        has = f"{prompt} input tokens" if prompt_tokens else "at least 1 input token"
        raise bad_request(f"{name}: too large: {value}. This model's maximum context length is {context} tokens "
                          f"and the request has {has} ({value} > {context} - {prompt}).", param=name,
                          code="context_length_exceeded")


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
        role = _role(message, where, CHAT_ROLES)
        content = message.get("content")
        if content is None and role == "assistant":
            continue
        _check_content(content, f"{where}.content", CHAT_PART_TYPES)


def _role(message: dict[str, Any], where: str, roles: frozenset[str]) -> str:
    role = message.get("role")
    # A role of any JSON type may come: only a string can be one (an object or a list is not even hashable).
    if not isinstance(role, str) or role not in roles:
        raise bad_request(f"{where}.role: must be one of {', '.join(sorted(roles))}.", param=f"{where}.role")
    return role


def _check_content(content: Any, where: str, types: frozenset[str]) -> None:
    """A string, or a non-empty list of parts, each an object whose ``type`` is one of ``types``."""
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise bad_request(f"{where}: must be a string or a non-empty list of content parts.", param=where)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{where}.{j}: must be an object with a string `type`.", param=f"{where}.{j}")
        _check_type(part["type"], f"{where}.{j}", types)


def _check_type(kind: str, where: str, types: frozenset[str]) -> None:
    if kind not in types:
        raise bad_request(f"{where}.type: must be one of {', '.join(sorted(types))}; got {kind[:40]!r}.",
                          param=f"{where}.type")


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


def check_token_ids_in_vocabulary(prompt: Any, vocabulary: int, name: str = "prompt") -> None:
    """A prompt of token ids (checked by :func:`_check_prompt`) holds only ids the model's tokenizer has, as vLLM
    requires: an id past it would reach a pod only to be refused there."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], str):
        return
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    top = max((max(ids) for ids in lists if ids and isinstance(ids[0], int)), default=-1)
    if top >= vocabulary:
        raise bad_request(f"{name}: token id {top} is out of the model's vocabulary ({vocabulary} tokens).",
                          param=name)


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _check_input(items: Any, may_be_empty: bool) -> None:
    if isinstance(items, str):
        return
    if not isinstance(items, list):
        raise bad_request("input: must be a string or a list of input items.", param="input")
    if not items and not may_be_empty:  # vLLM would have no conversation to render
        raise bad_request("input: at least one item is required (without instructions or a previous response).",
                          param="input")
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an object.", param=where)
        kind = item.get("type")
        if kind is None and "role" not in item:
            raise bad_request(f"{where}: must have a `role` or a string `type`.", param=where)
        if kind is None or kind == "message":  # a message's type may be left out
            _role(item, where, RESPONSES_ROLES)
            _check_content(item.get("content"), f"{where}.content", RESPONSES_PART_TYPES)
            continue
        if not isinstance(kind, str):
            raise bad_request(f"{where}.type: must be a string.", param=f"{where}.type")
        _check_type(kind, where, RESPONSES_ITEM_TYPES)
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


def check_content_type(headers: Mapping[str, str]) -> None:
    """Refuse (400, naming the header) a body its client says is not JSON (``text/plain``, a form, ...)."""
    value = headers.get("content-type")
    if value is None:
        return
    media = value.partition(";")[0].strip().lower()
    if media in _UNTYPED or media == "application/json" or (media.startswith("application/")
                                                            and media.endswith("+json")):
        return
    # What curl -d sends without -H: say how to fix it.
    hint = " (curl -d sends it: add -H 'content-type: application/json')" if media == _FORM else ""
    raise bad_request(f"content-type: must be application/json, got {value[:60]!r}{hint}.", param="content-type",
                      code="unsupported_media_type")


_FORM = "application/x-www-form-urlencoded"
# A body of no declared type: an empty header, or what HTTP libraries send for bytes given without one.
_UNTYPED = frozenset({"", "application/octet-stream"})


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse (400, naming the header) a value of a gateway header it cannot mean."""
    for name, (valid, expected, code) in HEADERS.items():
        value = headers.get(name)
        if value is not None and not valid(value):
            raise bad_request(f"{name}: must be {expected}, got {value[:40]!r}.", param=name, code=code)
