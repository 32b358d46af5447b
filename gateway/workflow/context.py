"""What a request says about its workflow, stage and session: the gateway's own headers, and the signals
real agent tools already send.

A request belongs to at most one context (:mod:`gateway.core.contexts`): its workflow, else its session,
else (decided later, by its prompt) an anonymous conversation. The signals are read in the order of
:data:`SESSION_SIGNALS`, the first one present wins, and its value is matched exactly: ``abc`` and
``abc-1`` are two sessions. Sub-agents are their own contexts (``session:<id>/agent:<agent>``): a Claude
Code sub-agent runs a conversation of its own (its own system prompt and history) beside its parent's
under the same session id, so one context for both would have its "last prompt" jump between the two
and never be continued; as its own context it is placed, held and continued as what it is, and where it
shares the parent's preamble the prefix index finds that on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
from multidict import CIMultiDictProxy

from gateway.core.contexts import context_key, owned
from gateway.core.errors import bad_request
from gateway.core.inference_api import InferenceRequest

CachePolicy = Literal["auto", "preserve", "flush"]

WORKFLOW_HEADERS = ("x-workflow-id", "x-orla-workflow-run")
STAGE_HEADERS = ("x-stage-id", "x-orla-stage")


@dataclass(frozen=True, slots=True)
class Signal:
    """Where a session id may come from, and who sends it."""

    where: Literal["header", "conversation", "prompt_cache_key", "metadata.user_id", "user"]
    name: str
    sender: str


# In order: the gateway's own header first, then what agent tools send, then the APIs' own fields.
SESSION_SIGNALS: tuple[Signal, ...] = (
    Signal("header", "x-session-id", "any client (the gateway's own header)"),
    Signal("header", "x-claude-code-session-id", "Claude Code"),
    Signal("header", "x-qwen-code-session-id", "Qwen Code"),
    Signal("header", "session_id", "Codex (Responses API)"),
    Signal("header", "conversation_id", "Codex (Responses API)"),
    Signal("header", "session-id", "Codex 0.169 (its Responses requests), other tools"),
    Signal("header", "thread-id", "Codex 0.169 (its Responses requests), other tools"),
    Signal("conversation", "conversation", "OpenAI Responses API (its conversation, or the one a "
           "previous_response_id continues)"),
    Signal("prompt_cache_key", "prompt_cache_key", "OpenAI API, Codex"),
    Signal("metadata.user_id", "metadata.user_id", "Anthropic API (Claude Code puts its session in it)"),
    Signal("user", "user", "OpenAI API (an end user: their conversations share one context)"),
)
# Sub-agents: a header naming the agent inside a session.
AGENT_HEADERS = ("x-claude-code-agent-id",)


class WorkflowContext(msgspec.Struct):
    workflow_id: str | None = None
    stage_id: str | None = None
    cache_policy: CachePolicy = "auto"
    preserve_threshold: int | None = None
    complete: bool = False
    session_id: str | None = None


def _first(headers: CIMultiDictProxy[str], names: Sequence[str]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value and (value := value.strip()):
            return value
    return None


def _conversation(value: object) -> str | None:
    """The Responses API's ``conversation``: an id, or an object with one."""
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) and value else None


class ContextSignals:
    """Reads a request's workflow and session: the built-in signals, then ``extra_headers`` (config
    ``workflow.session_headers``) for the tools the table does not know."""

    def __init__(self, extra_headers: Sequence[str] = ()) -> None:
        builtin = [s.name for s in SESSION_SIGNALS if s.where == "header"]
        self._session_headers = builtin + [h.lower() for h in extra_headers if h.lower() not in builtin]

    def workflow_id(self, headers: CIMultiDictProxy[str], body: InferenceRequest, owner: str = "") -> str | None:
        """The workflow, kept under its owner's tag (``owner``: the API key's; "" with keys off)."""
        meta = body.metadata
        sent = _first(headers, WORKFLOW_HEADERS) or (meta.workflow_id if meta else None)
        return owned(owner, sent) if sent else None

    def session_id(self, headers: CIMultiDictProxy[str], body: InferenceRequest, owner: str = "") -> str | None:
        """The session as sent, under its owner's tag; a sub-agent's is its own (``<session>/agent:<agent>``)."""
        meta = body.metadata
        session = (_first(headers, self._session_headers) or _conversation(body.conversation) or body.prompt_cache_key
                   or (meta.user_id if meta else None) or body.user)
        if session and (agent := _first(headers, AGENT_HEADERS)):
            session = f"{session}/agent:{agent}"
        return owned(owner, session) if session else None

    def context_key(self, headers: CIMultiDictProxy[str], body: InferenceRequest, owner: str = "") -> str | None:
        """The workflow or session a request continues, for placement (read even with workflow actions
        off; never an error: a bad cache-policy header is the workflow service's to refuse)."""
        return context_key(self.workflow_id(headers, body, owner), self.session_id(headers, body, owner))

    def parse(self, headers: CIMultiDictProxy[str], body: InferenceRequest, owner: str = "") -> WorkflowContext:
        """Everything the workflow service reads, the gateway's own headers checked."""
        meta = body.metadata
        stage = _first(headers, STAGE_HEADERS) or (meta.stage_id if meta else None)
        policy = (headers.get("x-stage-cache-policy") or "auto").strip().lower()
        if policy not in ("auto", "preserve", "flush"):
            raise bad_request("x-stage-cache-policy must be auto, preserve or flush.", param="x-stage-cache-policy")
        threshold = headers.get("x-stage-preserve-threshold")
        try:
            preserve_threshold = int(threshold) if threshold else None
        except ValueError:
            raise bad_request("x-stage-preserve-threshold must be a number of tokens.",
                              param="x-stage-preserve-threshold") from None
        if preserve_threshold is not None and preserve_threshold < 0:
            raise bad_request("x-stage-preserve-threshold must not be negative.", param="x-stage-preserve-threshold")
        return WorkflowContext(
            workflow_id=self.workflow_id(headers, body, owner), stage_id=stage, cache_policy=policy,  # type: ignore[arg-type]
            preserve_threshold=preserve_threshold,
            complete=(headers.get("x-workflow-complete") or "").strip().lower() == "true",
            session_id=self.session_id(headers, body, owner),
        )
