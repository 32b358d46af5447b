"""The shape every shipped profile shares: the gateway's own filters around the policy's, and the helpers
its policies declare their parts with."""

from __future__ import annotations

from typing import Any

from gateway.plugin_api import PartConfig, ProfileConfig, ScorerConfig


def part(name: str, **options: Any) -> PartConfig:
    return PartConfig(name, options)


def scorer(name: str, weight: float = 1.0, **options: Any) -> ScorerConfig:
    return ScorerConfig(name, options, weight)


def shipped(*filters: PartConfig, scorers: tuple[ScorerConfig, ...] = (), picker: PartConfig) -> ProfileConfig:
    """A shipped profile: its own filters between the gateway's (pods with room and adapter placement
    first, the pin last), its scorers and its picker."""
    return ProfileConfig(filters=[part("saturated"), part("adapter_resident"), *filters, part("pin")],
                         scorers=list(scorers), picker=picker)
