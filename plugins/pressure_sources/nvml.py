"""``nvml``: GPU memory use read through NVML (``nvidia-ml-py``), for a gateway running beside its GPUs.
Options: ``devices: {pod name: GPU index}``. Without the library or a GPU it is unavailable and the
monitor falls back to engine metrics."""

from __future__ import annotations

from typing import Any

from gateway.backends.registry import Pod
from gateway.plugin_registry import PluginSpec
from gateway.pressure.monitor import DeviceOptions, PressureContext, PressureSourceUnavailable


class NvmlSource:
    name = "nvml"

    def __init__(self, nvml: Any, devices: dict[str, int]) -> None:
        self._nvml = nvml
        self._handles = {pod: nvml.nvmlDeviceGetHandleByIndex(index) for pod, index in devices.items()}

    def usage(self, pod: Pod) -> float | None:
        handle = self._handles.get(pod.name)
        if handle is None:
            return None
        info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
        return info.used / info.total if info.total else None


def build(context: PressureContext, options: DeviceOptions) -> NvmlSource:
    try:
        import pynvml
    except ImportError as exc:
        raise PressureSourceUnavailable("nvidia-ml-py is not installed") from exc
    try:
        pynvml.nvmlInit()
        return NvmlSource(pynvml, options.devices)
    except pynvml.NVMLError as exc:
        raise PressureSourceUnavailable(f"NVML: {exc}") from exc


PLUGIN = PluginSpec(DeviceOptions, build)
