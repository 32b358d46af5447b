"""Each pod's KV-memory pressure mode: five levels, relaxed to emergency.

Owner: the pressure monitor (:mod:`gateway.pressure.monitor`) alone sets a pod's mode; pending load, workflow
planning and ``/debug/workflows`` read it.
"""

from __future__ import annotations

import enum


class PressureMode(enum.IntEnum):
    RELAXED = 0
    NORMAL = 1
    PRESSURE = 2
    CRITICAL = 3
    EMERGENCY = 4


class PressureModes:
    """Each pod's pressure mode (relaxed until the monitor says otherwise, and always when it is off)."""

    def __init__(self) -> None:
        self._modes: dict[str, PressureMode] = {}

    def mode(self, pod: str) -> PressureMode:
        return self._modes.get(pod, PressureMode.RELAXED)

    def in_emergency(self, pod: str) -> bool:
        return self._modes.get(pod, PressureMode.RELAXED) >= PressureMode.EMERGENCY

    def items(self) -> list[tuple[str, PressureMode]]:
        return list(self._modes.items())

    def set(self, pod: str, mode: PressureMode) -> None:
        """The monitor's alone."""
        self._modes[pod] = mode

    def forget_pod(self, pod: str) -> None:
        self._modes.pop(pod, None)
