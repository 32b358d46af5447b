"""The names of contexts: what one client keeps coming back with.

A context is a workflow (``workflow:<id>``), a session (``session:<key>``) or, with neither, a
conversation recognised by its prompt (``anon-<process>-<n>``, named by the working set that first saw
it). The in-flight ledger counts requests per context; the working set keeps each context's blocks; the
workflow tracker knows workflows by their id.
"""

from __future__ import annotations

_WORKFLOW = "workflow:"
# Between an owner's tag and the id its client sent: a workflow or session id is kept as ``<tag>/<id>``.
_OWNED = "/"
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


def owned(owner: str, client_id: str) -> str:
    """The id the gateway keeps a client's workflow or session under: its owner's (``owner``: its API key's
    tag; "" with keys off, the id as sent). Two keys naming the same id name two contexts."""
    return f"{owner}{_OWNED}{client_id}" if owner else client_id


def owner_in(kept_id: str) -> str:
    """The owner's tag of an id kept by :func:`owned` (with keys on, every kept id has one)."""
    return kept_id.partition(_OWNED)[0]
