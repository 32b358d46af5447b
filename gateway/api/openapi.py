"""The gateway's own OpenAPI description, served at ``/openapi.json`` (and used to fuzz it)."""

from __future__ import annotations

from typing import Any

_ERROR = {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/Error"}}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
    "content": {"type": "string", "maxLength": 2000}}}
_COMMON = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 32},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
}
_HEADERS = [
    {"name": name, "in": "header", "required": False, "schema": {"type": "string", "maxLength": 40}}
    for name in ("x-request-id", "x-routing-strategy", "x-workflow-id", "x-stage-id", "x-stage-cache-policy",
                 "x-stage-preserve-threshold", "x-workflow-complete", "x-session-id", "x-slo-ttft-ms",
                 "x-slo-e2e-ms", "x-priority")
]


def _post(summary: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "parameters": _HEADERS,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": required, "properties": {**_COMMON, **properties}}}}},
        "responses": {"200": {"description": "the pod's answer (JSON, or SSE when streaming)"}, "default": _ERROR},
    }}


def _get(summary: str, parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"get": {"summary": summary, "parameters": parameters or [],
                    "responses": {"200": {"description": "OK"}, "default": _ERROR}}}


_WORKFLOW_ID = [{"name": "workflow_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 40}}]
_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 40}}]


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "kv-gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible gateway routing by KV-cache prefix, load and SLO."},
        "paths": {
            "/v1/chat/completions": _post("Chat completion, routed", {
                "messages": {"type": "array", "minItems": 1, "maxItems": 8, "items": _MESSAGE}}, ["model", "messages"]),
            "/v1/completions": _post("Text completion, routed", {
                "prompt": {"oneOf": [{"type": "string", "maxLength": 2000},
                                     {"type": "array", "maxItems": 64, "items": {"type": "integer"}}]}},
                ["model", "prompt"]),
            "/v1/embeddings": _post("Embeddings, routed", {
                "input": {"oneOf": [{"type": "string", "maxLength": 2000},
                                    {"type": "array", "maxItems": 8, "items": {"type": "string"}}]}},
                ["model", "input"]),
            "/v1/responses": _post("Responses API, routed like chat", {
                "input": {"type": "string", "maxLength": 2000}, "instructions": {"type": "string"},
                "previous_response_id": {"type": "string", "maxLength": 40}, "store": {"type": "boolean"}},
                ["model", "input"]),
            "/v1/responses/{response_id}": {**_get("A stored response", _RESPONSE_ID), "delete": {
                "summary": "Delete a stored response", "parameters": _RESPONSE_ID,
                "responses": {"200": {"description": "OK"}, "default": _ERROR}}},
            "/v1/responses/{response_id}/input_items": _get("The input a stored response answered", [
                *_RESPONSE_ID, {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer"}},
                {"name": "order", "in": "query", "required": False, "schema": {"type": "string"}},
                {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}]),
            "/v1/responses/{response_id}/cancel": {"post": {
                "summary": "Cancel a response", "parameters": _RESPONSE_ID,
                "responses": {"200": {"description": "OK"}, "default": _ERROR}}},
            "/v1/models": _get("The union of the pods' models"),
            "/v1/workflows/{workflow_id}": _get("A workflow's tracked state", _WORKFLOW_ID),
            "/v1/workflows/{workflow_id}/complete": {"post": {
                "summary": "Mark a workflow complete", "parameters": _WORKFLOW_ID,
                "responses": {"200": {"description": "OK"}, "default": _ERROR}}},
            "/healthz": _get("Liveness"),
            "/readyz": _get("Readiness"),
        },
        "components": {"schemas": {"Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "code": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]}}}}}}},
    }
