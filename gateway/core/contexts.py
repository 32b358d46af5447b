"""The names of contexts: what one client keeps coming back with.

A context is a workflow (``workflow:<id>``), a session (``session:<key>``) or, with neither, a
conversation recognised by its prompt (``anon-<process>-<n>``, named by the working set that first saw
it). The in-flight ledger counts requests per context; the working set keeps each context's blocks; the
workflow tracker knows workflows by their id.
"""

from __future__ import annotations

_WORKFLOW = "workflow:"
_SESSION = "session:"


def workflow_key(workflow_id: str) -> str:
    return f"{_WORKFLOW}{workflow_id}"


def session_key(session_id: str) -> str:
    return f"{_SESSION}{session_id}"


def workflow_id_of(key: str) -> str | None:
    """The workflow id of a context key, if it names a workflow."""
    return key[len(_WORKFLOW):] if key.startswith(_WORKFLOW) else None


def context_key(workflow_id: str | None, session_id: str | None) -> str | None:
    """A request's keyed context: its workflow, else its session, else none."""
    if workflow_id:
        return workflow_key(workflow_id)
    return session_key(session_id) if session_id else None
