"""``none``: no hard flush; flushes stay soft (the workflow simply stops being pinned)."""

from __future__ import annotations


def build() -> None:
    return None
