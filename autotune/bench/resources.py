"""Peak memory during a run: GPU memory sampled through NVML, and the server process tree's peak RSS.

RSS comes from /proc/<pid>/status: VmHWM is the kernel's own high-water mark, so a spike between
samples is not missed. Without NVML (no GPU) or without a pid, the readings are None, not errors.
"""
import os
import threading
from pathlib import Path

GIB = 1024 ** 3


class ResourceSampler:
    """Samples, in a background thread, used memory summed over every visible GPU and the server's peak RSS.

    The last sample is kept if the server dies or the GPU is lost mid-run.
    """

    def __init__(self, server_pid: int | None = None, interval_s: float = 0.25):
        self.server_pid, self.interval_s = server_pid, interval_s
        self.peak_gpu_bytes: int | None = None
        self.peak_rss_kib: int | None = None
        self._stop = threading.Event()
        self._thread = None
        self._handles = []
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no driver, no GPU, no library: nothing to sample
            self._nvml = None

    def sample(self):
        if self._handles:
            try:
                used = sum(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles)
                self.peak_gpu_bytes = max(used, self.peak_gpu_bytes or 0)
            except Exception:  # noqa: BLE001 - GPU lost mid-run: keep the peak seen so far
                self._handles = []
        if self.server_pid is not None:
            rss = tree_peak_rss_kib(self.server_pid)
            if rss is not None:
                self.peak_rss_kib = max(rss, self.peak_rss_kib or 0)

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    @property
    def peak_gpu_mem_gb(self) -> float | None:
        return None if self.peak_gpu_bytes is None else self.peak_gpu_bytes / GIB

    @property
    def peak_rss_gb(self) -> float | None:
        return None if self.peak_rss_kib is None else self.peak_rss_kib * 1024 / GIB


def status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (servers such as SGLang run workers in child processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                # the command name may hold spaces and parentheses: ppid is the 2nd field after the last ')'
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def tree_peak_rss_kib(pid: int) -> int | None:
    """Sum of VmHWM over the process tree of pid (VmRSS where HWM is not reported); None if it is gone."""
    kib = [status_kib(p, "VmHWM") or status_kib(p, "VmRSS") for p in process_tree(pid)]
    kib = [k for k in kib if k is not None]
    return sum(kib) if kib else None
