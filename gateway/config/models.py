"""What a model name means: aliases, splits, fallbacks, and LoRA adapters registered on demand."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class ModelTarget(msgspec.Struct, forbid_unknown_fields=True):
    """One target of a weighted split: a model or adapter the pods serve, and its share."""

    model: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.model or not self.weight > 0:
            raise ValueError("a split's target needs a model and a positive weight")


class ModelRule(msgspec.Struct, forbid_unknown_fields=True):
    """What a public model name means: one target (an alias) or weighted targets (a split, sticky per
    workflow, session or conversation), then the fallbacks tried in order when the chosen target has no
    healthy pod, its requests would wait longer than ``fallback_wait_s`` in flow control, or its pods fail
    before the first byte."""

    target: str | None = None
    targets: list[ModelTarget] = []
    fallbacks: list[str] = []
    # Whether the answer names the target that served it (true) or the public name the client asked for.
    expose_target: bool = False
    # How long a request may wait in flow control for a target that has a fallback after it (0: a
    # saturated target hands the request to its fallback at once).
    fallback_wait_s: Annotated[float, Meta(ge=0)] = 0.0

    def __post_init__(self) -> None:
        if (self.target is None) == (not self.targets):
            raise ValueError("a model rule names either target (an alias) or targets (a split)")
        chosen = self.choices()
        if len(set(chosen)) != len(chosen) or set(chosen) & set(self.fallbacks) \
                or len(set(self.fallbacks)) != len(self.fallbacks):
            raise ValueError("a model rule names each target and fallback once")

    def choices(self) -> list[str]:
        """The targets a request may be given (before any fallback)."""
        return [self.target] if self.target is not None else [t.model for t in self.targets]


class AdapterConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A LoRA adapter the gateway registers on a pod of its base model when a request needs it."""

    path: str  # as the pod reads it: a directory on the pod, or a URI its engine resolves
    base_model: str

    def __post_init__(self) -> None:
        if not self.path or not self.base_model:
            raise ValueError("an adapter needs a path and a base_model")


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Loading adapters where they are needed (``gateway/models/adapters.py``)."""

    # A registration still unanswered after this long is given up (the request tries another pod).
    load_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # An adapter the gateway registered, idle on a pod this long after its last request ended, is unregistered
    # there; 0: never.
    idle_unload_s: Annotated[float, Meta(ge=0)] = 600.0
    # What placing a request where its adapter is not in the engine's batch slots costs, in prompt tokens
    # (the weights copied into a slot, and the requests of other adapters that wait meanwhile) ...
    switch_cost_tokens: Annotated[int, Meta(ge=0)] = 512
    # ... and, on a pod that has not registered it, what reading it from its path costs besides.
    load_cost_tokens: Annotated[int, Meta(ge=0)] = 2048


class ModelsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Model names that platform teams manage (``gateway/models/``): public names and what they mean, and
    the adapters loaded on demand. Reloaded with the config file."""

    rules: dict[str, ModelRule] = {}
    adapters: dict[str, AdapterConfig] = {}
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        for public, rule in self.rules.items():
            chained = [t for t in (*rule.choices(), *rule.fallbacks) if t in self.rules]
            if chained:
                raise ValueError(f"models.rules.{public}: {', '.join(chained)} is a public name itself; a "
                                 "target names a served model or adapter")
            if public in self.adapters:
                raise ValueError(f"models.rules.{public}: also an adapter's name")
