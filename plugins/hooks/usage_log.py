"""``usage_log``: a response-complete hook that writes one structured line per request to a logger of its
own (``logger``, at INFO): the pod that served it, its status and outcome, the tokens the pod's usage
reported, its time to first byte and in all. The access log says how each request was routed; this line is
what a usage or billing pipeline reads (``logging.format: json`` makes each field a key).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from gateway.plugin_api import HookContext, PluginSpec, ResponseView


class UsageLogOptions(msgspec.Struct, forbid_unknown_fields=True):
    logger: str = "gateway.usage"


class UsageLog:
    def __init__(self, logger: str) -> None:
        self._log = logging.getLogger(logger)

    def response_complete(self, response: ResponseView) -> None:
        if not self._log.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": response.request_id, "model": response.model, "pod": response.pod,
            "status": response.status, "outcome": response.outcome, "prompt_tokens": response.prompt_tokens,
            "completion_tokens": response.completion_tokens,
            "ttfb_ms": round(response.first_byte_s * 1000, 2) if response.first_byte_s is not None else None,
            "duration_ms": round(response.total_s * 1000, 2),
        }
        self._log.info("usage id=%s model=%s pod=%s status=%d outcome=%s prompt_tokens=%s completion_tokens=%s",
                       response.request_id, response.model, response.pod, response.status, response.outcome,
                       response.prompt_tokens, response.completion_tokens, extra=fields)


def _build(context: HookContext, options: UsageLogOptions) -> UsageLog:
    return UsageLog(options.logger)


PLUGIN = PluginSpec(UsageLogOptions, _build)
