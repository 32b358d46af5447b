"""``rocm_smi``: GPU memory use read through ROCm SMI (``pyrsmi``), for AMD GPUs beside the gateway.
Options: ``devices: {pod name: GPU index}``. Without the library or a GPU it is unavailable and the
monitor falls back to engine metrics."""

from __future__ import annotations

from typing import Any

from gateway.backends.registry import Pod
from gateway.plugin_registry import PluginSpec
from gateway.pressure.monitor import DeviceOptions, PressureContext, PressureSourceUnavailable


class RocmSmiSource:
    name = "rocm_smi"

    def __init__(self, rocml: Any, devices: dict[str, int]) -> None:
        self._rocml = rocml
        self._devices = devices

    def usage(self, pod: Pod) -> float | None:
        index = self._devices.get(pod.name)
        if index is None:
            return None
        total = self._rocml.smi_get_device_memory_total(index)
        return self._rocml.smi_get_device_memory_used(index) / total if total else None


def build(context: PressureContext, options: DeviceOptions) -> RocmSmiSource:
    try:
        from pyrsmi import rocml
    except ImportError as exc:
        raise PressureSourceUnavailable("pyrsmi is not installed") from exc
    try:
        rocml.smi_initialize()
    except Exception as exc:  # the library raises its own types when no ROCm device or driver is present
        raise PressureSourceUnavailable(f"ROCm SMI: {exc}") from exc
    return RocmSmiSource(rocml, options.devices)


PLUGIN = PluginSpec(DeviceOptions, build)
