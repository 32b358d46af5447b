"""The parts of OpenAI (and Anthropic Messages) request bodies the gateway reads.

Bodies are decoded once into these structs to route; the bytes sent upstream are the client's own, never
re-encoded (but for the bodies of a disaggregated request's two legs: :mod:`gateway.request.disaggregation`).
Unknown fields are ignored (engines accept many extensions), while the fields we read are checked strictly so
a wrong type is a clear 400, not a surprise later.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from gateway.core.errors import GatewayError, bad_request


class RequestKind(enum.StrEnum):
    """The API a request came in by (its path's family); its values are the names metrics and logs carry."""

    CHAT = "chat"  # POST /v1/chat/completions
    COMPLETIONS = "completions"  # POST /v1/completions
    RESPONSES = "responses"  # POST /v1/responses
    EMBEDDINGS = "embeddings"  # POST /v1/embeddings
    MESSAGES = "messages"  # POST /v1/messages (Anthropic)
    COUNT_TOKENS = "count_tokens"  # POST /v1/messages/count_tokens (Anthropic)

    @property
    def anthropic(self) -> bool:
        """Whether the client speaks Anthropic's API (its errors take Anthropic's shape)."""
        return self in (RequestKind.MESSAGES, RequestKind.COUNT_TOKENS)

    @property
    def conversational(self) -> bool:
        """Whether its prompt is a conversation rendered by the model's chat template."""
        return self in (RequestKind.CHAT, RequestKind.RESPONSES, RequestKind.MESSAGES)


# The route of each kind the gateway proxies, and back.
PATHS: dict[RequestKind, str] = {
    RequestKind.CHAT: "/v1/chat/completions",
    RequestKind.COMPLETIONS: "/v1/completions",
    RequestKind.RESPONSES: "/v1/responses",
    RequestKind.EMBEDDINGS: "/v1/embeddings",
    RequestKind.MESSAGES: "/v1/messages",
    RequestKind.COUNT_TOKENS: "/v1/messages/count_tokens",
}
# The routes whose clients speak Anthropic's API (and get its error shape).
ANTHROPIC_PATHS = frozenset(path for kind, path in PATHS.items() if kind.anthropic)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class Metadata(msgspec.Struct):
    workflow_id: str | None = None
    stage_id: str | None = None
    user_id: str | None = None  # Anthropic's: the end user (agent tools put their session here)


class InferenceRequest(msgspec.Struct):
    """Routing-relevant fields shared by chat, completions, responses and embeddings bodies."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: Any = None
    input: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None  # the Responses API's
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # checked by gateway.core.retention
    metadata: Metadata | None = None
    # What changes the engine's rendering of a chat prompt, passed through to tokenization.
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    instructions: Any = None
    # The Responses API's state: the response this one continues, whether to keep this one, and the
    # background mode (kept by the pod that runs it).
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    # The OpenAI Responses API's conversation (a string id, or an object with one); the gateway also names
    # here the conversation a ``previous_response_id`` continues (a session for placement).
    conversation: Any = None
    # Anthropic Messages: the system prompt, and what changes how the engine renders the conversation.
    system: Any = None
    thinking: Any = None
    output_config: Any = None
    tool_choice: Any = None


_decoder = msgspec.json.Decoder(InferenceRequest)


def parse_inference_request(body: bytes) -> InferenceRequest:
    if not body:
        raise bad_request("The request body is empty; a JSON object is required.")
    try:
        req = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError as exc:  # msgspec checks UTF-8 as it decodes strings
        raise bad_request(f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}.",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("The request body nests JSON too deeply.", code="invalid_json") from None
    if not req.model:
        raise bad_request("model: you must provide a model parameter.", param="model", code="missing_model")
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise bad_request(f"{name}: must be at least 1, got {value}.", param=name)
    return req


def _field_error(detail: str) -> GatewayError:
    # msgspec says "... - at `$.messages[0]`"; surface the field as the OpenAI ``param``.
    param = None
    if "at `$." in detail:
        param = detail.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
    if detail.startswith("Expected `object`, got") and "at `$" not in detail:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    return bad_request(f"{param}: {detail}" if param else f"Invalid request: {detail}", param=param)
