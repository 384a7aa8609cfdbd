"""This host's accelerators and CPU/RAM for the monitor's system panel (pure: no textual).

GPUs through NVML (the `pynvml` module of nvidia-ml-py) when it imports and finds a driver;
otherwise CPU and RAM through psutil. A run on other nodes shows the monitoring host only:
the panel says which host it describes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    util_percent: float | None
    mem_used: int  # bytes
    mem_total: int


@dataclass(frozen=True)
class SysSample:
    host: str
    source: str  # "nvml" | "psutil" | "none"
    gpus: tuple[GpuSample, ...] = ()
    cpu_percent: float | None = None
    ram_used: int | None = None
    ram_total: int | None = None
    note: str | None = None  # why GPUs are not shown


class Sampler:
    """Call sample() every few seconds; each call is cheap (no sleeping, no subprocess)."""

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self._nvml = None
        self.note: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except ImportError:
            self.note = "no GPU view: nvidia-ml-py is not installed"
        except Exception as e:  # pynvml.NVMLError and friends: no driver, no device
            self._nvml = None
            self.note = f"no GPU view: NVML unavailable ({type(e).__name__})"
        try:
            import psutil

            self._psutil = psutil
            psutil.cpu_percent(interval=None)  # prime: the next call measures since now
        except ImportError:
            self._psutil = None

    def sample(self) -> SysSample:
        gpus: tuple[GpuSample, ...] = ()
        source = "none"
        if self._nvml is not None:
            try:
                gpus = tuple(self._gpu(i, h) for i, h in enumerate(self._handles))
                source = "nvml"
            except Exception as e:  # a GPU fell off the bus, the driver was reloaded
                self.note = f"NVML error: {type(e).__name__}"
        cpu = ram_used = ram_total = None
        if self._psutil is not None:
            cpu = self._psutil.cpu_percent(interval=None)
            vm = self._psutil.virtual_memory()
            ram_used, ram_total = int(vm.total - vm.available), int(vm.total)
            if source == "none":
                source = "psutil"
        return SysSample(host=self.host, source=source, gpus=gpus, cpu_percent=cpu, ram_used=ram_used,
                         ram_total=ram_total, note=None if gpus else self.note)

    def _gpu(self, index: int, handle) -> GpuSample:
        nv = self._nvml
        name = nv.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        try:
            util = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # some MIG slices report no utilisation
            util = None
        return GpuSample(index, str(name), util, int(mem.used), int(mem.total))

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


class FixedSampler:
    """Always the same sample: for snapshot tests and benchmarks, where the host's load varies."""

    def __init__(self, sample: SysSample):
        self._sample = sample

    def sample(self) -> SysSample:
        return self._sample

    def close(self) -> None:
        pass


def fmt_used(used: int | None, total: int | None) -> str:
    """'8.0/32.0 GiB': both in the unit of the total."""
    if used is None or not total:
        return "-"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    k = 0
    while total >= 1024 ** (k + 1) and k < len(units) - 1:
        k += 1
    d = 1024 ** k
    return f"{used / d:.1f}/{total / d:.1f} {units[k]}"
