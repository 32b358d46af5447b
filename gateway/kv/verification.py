"""Routing that checks itself: the cached prefix the gateway predicted against what the engine reports.

Every precise router degrades silently when its tokenizer or chat template drifts from the engine's (a
new model revision, a template change, an adapter): predictions stay confident while the engines find
other tokens. The engines say what they found. An answer whose usage carries
``prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``; streams with
``stream_options.include_usage``) and ``prompt_tokens`` is compared with the gateway's prediction for
the chosen pod and with its own token count:

- ``prompt_tokens_mismatch``: the engine counted another prompt length (a tokenizer or template drift
  shows here first);
- ``exact``, ``near`` (within ``tolerance_tokens``), ``over`` (the engine had fewer cached tokens than
  predicted), ``under`` (more).

The prediction compared is the part the pods' own events confirmed: blocks only expected from recent
routing are left out, since a request that follows another with the same prefix often reaches the
engine before that one's blocks are computed. ``under`` is not a miss either: the engine also caches what
other gateways sent it, and events can still be on their way. A model *drifts* when, among its last
``window`` checked answers (at least ``min_samples``), at least ``max_miss_share`` were a mismatch or
over. The drift is logged once, exported as
``gateway_kv_drift{model}``, and the model is tokenized by a pod's ``/tokenize`` (or, failing that,
routed approximately) until ``recover_after`` probes in a row (one request in ``probe_every`` is also
tokenized locally) count the prompt as the engine does again.

Owner: the :class:`PredictionVerifier` owns each model's window and drift state; the prediction-check
step of the request pipeline feeds it, tokenization and ``/debug/index`` read it.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.config import VerificationConfig
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.kv.verification")

MISSES = frozenset({"prompt_tokens_mismatch", "over"})
PREDICTION_ERROR_BUCKETS = (-4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096)


class PredictionMetrics:
    """The checks' families, on the gateway's registry (:meth:`GatewayMetrics.owned`). Producer:
    :class:`PredictionVerifier`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.error = Histogram(
            "gateway_kv_prediction_error_tokens",
            "Predicted minus engine-reported cached prompt tokens, per answered request",
            ["model", "pod"], buckets=PREDICTION_ERROR_BUCKETS, registry=registry,
        )
        self.outcomes = Counter(
            "gateway_kv_prediction_exact",
            "Cached-prefix predictions checked against the engine: exact, near (within tolerance), over, "
            "under, or prompt_tokens_mismatch (the engine counted another prompt length)",
            ["model", "pod", "outcome"], registry=registry,
        )
        self.drift = Gauge("gateway_kv_drift", "1 while a model's predictions keep missing", ["model"],
                           registry=registry)


@dataclass(slots=True)
class ModelChecks:
    """One model's recent outcomes and drift state."""

    misses: deque[bool]
    drifting: bool = False
    requests_while_drifting: int = 0
    agreeing_probes: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)


def outcome_of(predicted: int, reported: int, gateway_tokens: int, engine_tokens: int, tolerance: int) -> str:
    if gateway_tokens != engine_tokens:
        return "prompt_tokens_mismatch"
    if predicted == reported:
        return "exact"
    if abs(predicted - reported) <= tolerance:
        return "near"
    return "over" if predicted > reported else "under"


class PredictionVerifier:
    def __init__(self, config: VerificationConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self._metrics = metrics.owned(PredictionMetrics)
        self._models: dict[str, ModelChecks] = {}

    def _checks(self, model: str) -> ModelChecks:
        checks = self._models.get(model)
        if checks is None:
            checks = self._models[model] = ModelChecks(deque(maxlen=self.config.window))
        return checks

    # Reads

    def drifting(self, model: str) -> bool:
        checks = self._models.get(model)
        return checks is not None and checks.drifting

    def probe_due(self, model: str) -> bool:
        """While ``model`` drifts: whether this request should also be tokenized locally, as a probe."""
        checks = self._models.get(model)
        if checks is None or not checks.drifting:
            return False
        checks.requests_while_drifting += 1
        return checks.requests_while_drifting % self.config.probe_every == 0

    def debug(self) -> dict[str, Any]:
        return {model: {"drifting": c.drifting, "recent": len(c.misses), "recent_misses": sum(c.misses),
                        "outcomes": dict(c.outcomes)}
                for model, c in self._models.items()}

    # Writes (the prediction-check step)

    def observe(self, model: str, pod: str, predicted: int, reported: int, gateway_tokens: int,
                engine_tokens: int) -> str:
        """One answered request whose prefix was predicted from token ids: its outcome."""
        outcome = outcome_of(predicted, reported, gateway_tokens, engine_tokens, self.config.tolerance_tokens)
        self._metrics.outcomes.labels(model, pod, outcome).inc()
        if outcome != "prompt_tokens_mismatch":
            self._metrics.error.labels(model, pod).observe(predicted - reported)
        checks = self._checks(model)
        checks.outcomes[outcome] = checks.outcomes.get(outcome, 0) + 1
        checks.misses.append(outcome in MISSES)
        if not checks.drifting and self._drifted(checks):
            self._start_drift(model, checks)
        return outcome

    def probe(self, model: str, local_tokens: int, engine_tokens: int) -> None:
        """A drifting model's request was also tokenized locally: does the local count agree again?"""
        checks = self._models.get(model)
        if checks is None or not checks.drifting:
            return
        checks.agreeing_probes = checks.agreeing_probes + 1 if local_tokens == engine_tokens else 0
        if checks.agreeing_probes >= self.config.recover_after:
            checks.drifting = False
            checks.misses.clear()
            self._metrics.drift.labels(model).set(0)
            log.warning("model %s: the local tokenizer agrees with the engines again; precise routing resumes",
                        model)

    def _drifted(self, checks: ModelChecks) -> bool:
        samples = len(checks.misses)
        return samples >= self.config.min_samples and sum(checks.misses) >= self.config.max_miss_share * samples

    def _start_drift(self, model: str, checks: ModelChecks) -> None:
        checks.drifting = True
        checks.requests_while_drifting = 0
        checks.agreeing_probes = 0
        self._metrics.drift.labels(model).set(1)
        log.warning(
            "model %s: %d of the last %d cached-prefix predictions missed (%s); the gateway's tokenizer or chat "
            "template seems to differ from the engines'. Tokenizing by the pods' /tokenize (or routing by "
            "approximate prefix) until local tokenization agrees again.",
            model, sum(checks.misses), len(checks.misses),
            ", ".join(f"{k} {v}" for k, v in sorted(checks.outcomes.items())))
