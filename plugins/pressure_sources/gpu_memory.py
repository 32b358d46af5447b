"""GPU memory use read beside the GPUs, for a gateway running on their host: ``nvml`` through NVML
(``nvidia-ml-py``), ``rocm_smi`` through ROCm SMI (``pyrsmi``, AMD GPUs). Options: ``devices: {pod name: GPU
index}``. Without the library or a GPU a source is unavailable and the monitor falls back to engine metrics."""

from __future__ import annotations

import importlib
from typing import Any

from gateway.plugin_api import DeviceOptions, PluginSpec, Pod, PressureContext, PressureSourceUnavailable


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


def _library(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PressureSourceUnavailable(f"{package} is not installed") from exc


def build_nvml(context: PressureContext, options: DeviceOptions) -> NvmlSource:
    pynvml = _library("pynvml", "nvidia-ml-py")
    try:
        pynvml.nvmlInit()
        return NvmlSource(pynvml, options.devices)
    except pynvml.NVMLError as exc:
        raise PressureSourceUnavailable(f"NVML: {exc}") from exc


def build_rocm_smi(context: PressureContext, options: DeviceOptions) -> RocmSmiSource:
    rocml = _library("pyrsmi.rocml", "pyrsmi")
    try:
        rocml.smi_initialize()
    except Exception as exc:  # the library raises its own types when no ROCm device or driver is present
        raise PressureSourceUnavailable(f"ROCm SMI: {exc}") from exc
    return RocmSmiSource(rocml, options.devices)


NVML = PluginSpec(DeviceOptions, build_nvml)
ROCM_SMI = PluginSpec(DeviceOptions, build_rocm_smi)
