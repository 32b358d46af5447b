"""The pressure sources that read GPU memory beside the GPUs: the share in use per pod, and unavailable (the
monitor falls back to engine metrics) without their library. No GPU here: the libraries are stood in for by
objects with their calls."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from gateway.config import PodConfig
from gateway.pods.registry import Pod
from gateway.pressure.monitor import DeviceOptions, PressureSourceUnavailable
from plugins.pressure_sources.gpu_memory import NvmlSource, RocmSmiSource, build_nvml, build_rocm_smi


def pod(name: str) -> Pod:
    return Pod(config=PodConfig(name=name, url="http://127.0.0.1:9"), name=name, url="http://127.0.0.1:9")


def test_nvml_reads_each_pods_gpu():
    memory = {0: (30, 100), 1: (0, 0)}  # index: (used, total)
    nvml = SimpleNamespace(nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
                           nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=memory[int(h[3:])][0],
                                                                             total=memory[int(h[3:])][1]))
    source = NvmlSource(nvml, {"a": 0, "b": 1})
    assert source.usage(pod("a")) == 0.3
    assert source.usage(pod("b")) is None  # a device that reports no memory says nothing
    assert source.usage(pod("c")) is None  # not mapped to a GPU


def test_rocm_smi_reads_each_pods_gpu():
    rocml = SimpleNamespace(smi_get_device_memory_total=lambda i: 64, smi_get_device_memory_used=lambda i: 16 * i)
    source = RocmSmiSource(rocml, {"a": 1, "b": 3})
    assert (source.usage(pod("a")), source.usage(pod("b")), source.usage(pod("c"))) == (0.25, 0.75, None)


@pytest.mark.parametrize(("build", "library", "says"), [(build_nvml, "pynvml", "nvidia-ml-py is not installed"),
                                                        (build_rocm_smi, "pyrsmi", "pyrsmi is not installed")])
def test_without_its_library_a_source_is_unavailable(monkeypatch, build, library, says):
    monkeypatch.setitem(sys.modules, library, None)  # import fails as if not installed
    with pytest.raises(PressureSourceUnavailable, match=says):
        build(None, DeviceOptions(devices={"a": 0}))
