"""Resource sampler: a daemon thread emitting a `resource` event every telemetry.resource_interval seconds, the
first one FIRST_SAMPLE_S after the start (a node that has just joined shows its figures at once).

NVML (nvidia-ml-py) when this node trains on CUDA and the library loads: one event per GPU of this node with
util (percent), mem_used/mem_total (bytes), temp_c and power_w. Otherwise psutil: system CPU util (percent),
this process's RSS as mem_used and the host's memory as mem_total, with device "cpu".
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import psutil

FIRST_SAMPLE_S = 0.5  # long enough for psutil's CPU window to mean something


def nvml_ids(cuda_indices: list[int], visible: tuple[str, ...] | None) -> list[str]:
    """NVML ignores CUDA_VISIBLE_DEVICES: cuda:i is the i-th visible GPU, an NVML index or a GPU UUID."""
    if visible is None:
        return [str(i) for i in cuda_indices]
    return [visible[i] for i in cuda_indices if i < len(visible)]


class _Nvml:
    def __init__(self, ids: list[str]):
        import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(int(i)) if i.isdigit()
                         else pynvml.nvmlDeviceGetHandleByUUID(i)) for i in ids]

    def samples(self) -> list[dict[str, Any]]:
        n = self.nvml
        out = []
        for index, h in self.handles:
            mem = n.nvmlDeviceGetMemoryInfo(h)
            gpu = int(index) if index.isdigit() else index  # the NVML index, or the UUID it was named by
            out.append(dict(device="gpu", index=gpu, util=float(n.nvmlDeviceGetUtilizationRates(h).gpu),
                            mem_used=int(mem.used), mem_total=int(mem.total),
                            temp_c=int(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                            power_w=n.nvmlDeviceGetPowerUsage(h) / 1000.0))
        return out

    def close(self) -> None:
        self.nvml.nvmlShutdown()


class _Psutil:
    def __init__(self) -> None:
        self.proc = psutil.Process()
        psutil.cpu_percent(None)  # the first call only starts the measurement window

    def samples(self) -> list[dict[str, Any]]:
        return [dict(device="cpu", util=float(psutil.cpu_percent(None)), mem_used=int(self.proc.memory_info().rss),
                     mem_total=int(psutil.virtual_memory().total))]

    def close(self) -> None:
        pass


def make_sampler(gpu_indices: list[str]) -> tuple[_Nvml | _Psutil, str | None]:
    """NVML for these GPUs when it loads, psutil otherwise (no GPU, no driver, or no library).
    The second value says why a node training on GPUs reports CPU figures instead (None when it does not)."""
    if gpu_indices:
        try:
            return _Nvml(gpu_indices), None
        except Exception as e:  # noqa: BLE001 - any NVML failure (no driver, no library) means: fall back to psutil
            return _Psutil(), f"NVML unavailable ({type(e).__name__}: {e}); reporting CPU and RSS instead of GPUs"
    return _Psutil(), None


class ResourceMonitor:
    """Start with .start(); .stop() ends the thread within one interval. `emit(**fields)` sends one event."""

    def __init__(self, emit: Callable[..., Any], interval: float, gpu_indices: list[int],
                 visible: tuple[str, ...] | None = None):
        self.emit, self.interval = emit, interval
        self.sampler, self.fallback_reason = make_sampler(nvml_ids(gpu_indices, visible))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resources", daemon=True)

    @property
    def kind(self) -> str:
        return "gpu" if isinstance(self.sampler, _Nvml) else "cpu"

    def start(self) -> "ResourceMonitor":
        self._thread.start()
        return self

    def sample_once(self) -> None:
        for fields in self.sampler.samples():
            self.emit(**fields)

    def _run(self) -> None:
        wait = min(self.interval, FIRST_SAMPLE_S)
        while not self._stop.wait(wait):
            self.sample_once()
            wait = self.interval

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)
        self.sampler.close()
