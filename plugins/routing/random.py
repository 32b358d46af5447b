"""``random``: a uniformly random candidate."""

from __future__ import annotations

import random

from gateway.routing.pickers import RandomPicker
from gateway.routing.policy import Policy, PolicyContext


def build(context: PolicyContext) -> Policy:
    seed = context.options.get("seed")
    return Policy(name="random", picker=RandomPicker(random.Random(seed)))
