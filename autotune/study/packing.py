"""Share one machine among trials that run side by side: disjoint GPU sets, CPU threads, ports.

A trial that needs n GPUs (its tensor-parallel size) gets n GPUs no other trial holds, inside one
NVLink domain when the machine has one that large (a TP group split over PCIe would measure the
link, not the configuration), as an aligned block where it can (TP=1 trials fill the holes instead
of scattering and stranding a TP=4 request), in the tightest domain that fits. Requests are served
first come, first served: a TP=8 trial waits until all eight GPUs are free and later small trials
queue behind it instead of starving it. On a CPU machine the cores are split: each of N embedded
engines gets cores // N threads.
"""
from __future__ import annotations

import collections
import os
import re
import threading

from autotune.engines.launcher import free_port, release_port


class Cancelled(Exception):
    """A wait for GPUs given up because the run is stopping."""


def nvlink_domains(gpus: list[int], topology: dict | None) -> list[list[int]]:
    """GPUs joined by NVLink (NV# in the `nvidia-smi topo -m` matrix), as connected groups. Without
    a topology, or without any NVLink, all GPUs are alike: one domain."""
    if not topology or len(topology.get("links") or []) <= max(gpus, default=0):
        return [list(gpus)] if gpus else []
    links = topology["links"]
    domains: list[list[int]] = []
    seen: set[int] = set()
    for start in gpus:
        if start in seen:
            continue
        group, todo = [], [start]
        seen.add(start)
        while todo:
            g = todo.pop()
            group.append(g)
            for other in gpus:
                if other not in seen and re.fullmatch(r"NV\d+", str(links[g][other]).strip()):
                    seen.add(other)
                    todo.append(other)
        domains.append(sorted(group))
    return domains if any(len(d) > 1 for d in domains) else [list(gpus)]


def usable_gpus(hardware, environ=os.environ) -> list[int]:
    """The probed GPUs, restricted to CUDA_VISIBLE_DEVICES when this process was given one."""
    indices = [g.index for g in getattr(hardware, "gpus", None) or []]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return indices
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r}: use GPU indices (not UUIDs) to run trials in parallel")
    return [i for i in indices if str(i) in entries]


def gpus_needed(config: dict, machine_has_gpus: bool, adapter) -> int:
    """GPUs one trial of `config` occupies: its tensor-parallel size (the engine adapter's `tp_size`)
    on a GPU machine, none on a CPU."""
    return adapter.tp_size(config) if machine_has_gpus else 0


def visible_devices(gpus: tuple[int, ...]) -> dict[str, str]:
    """Environment that shows a trial's engine its GPUs only, numbered the way NVML (the probe) numbers them."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if gpus else {}


def cpu_share(cores: int, slots: int) -> int:
    """Threads per engine when `slots` engines share `cores` CPU cores (never more threads than cores)."""
    if slots > cores:
        raise ValueError(f"--parallel {slots} needs at least {slots} CPU cores (one per engine); this machine has {cores}")
    return cores // slots


class GpuPool:
    """Hands out disjoint GPU sets; thread-safe; never more GPUs busy than there are."""

    def __init__(self, gpus: list[int], domains: list[list[int]] | None = None):
        self.gpus = list(gpus)
        self.domains = domains or [list(gpus)]
        self.free = set(gpus)
        self.queue: collections.deque = collections.deque()  # waiting requests, oldest first
        self.cond = threading.Condition()

    @classmethod
    def for_hardware(cls, hardware) -> GpuPool:
        gpus = usable_gpus(hardware)
        return cls(gpus, nvlink_domains(gpus, getattr(hardware, "topology", None)))

    def place(self, n: int) -> tuple[int, ...] | None:
        """The free GPUs a request for n would get now; None when it has to wait."""
        if len(self.free) < n:
            return None
        fitting = [d for d in self.domains if len(d) >= n]
        if not fitting:  # larger than any NVLink domain: whole free domains first
            whole = [g for d in self.domains if set(d) <= self.free for g in d]
            return tuple(sorted((whole + sorted(self.free - set(whole)))[:n]))
        best = None
        for domain in fitting:
            free = [g for g in domain if g in self.free]
            if len(free) < n:
                continue
            blocks = [domain[i:i + n] for i in range(0, len(domain) - n + 1, n)]
            block = next((b for b in blocks if set(b) <= self.free), None)
            key = (block is None, len(free))  # an aligned block, then the tightest domain
            if best is None or key < best[0]:
                best = (key, tuple(block or free[:n]))
        return best[1] if best else None

    def acquire(self, n: int, cancelled=lambda: False) -> tuple[int, ...]:
        """Block until n GPUs can be had (in request order); raises Cancelled when `cancelled()` turns true."""
        if n > len(self.gpus):
            raise ValueError(f"a trial needs {n} GPUs; only {len(self.gpus)} can be used here")
        if n == 0:
            return ()
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            try:
                while True:
                    got = self.place(n) if self.queue[0] is ticket else None
                    if got:
                        self.free -= set(got)
                        return got
                    if cancelled():
                        raise Cancelled
                    self.cond.wait(0.5)
            finally:
                self.queue.remove(ticket)
                self.cond.notify_all()

    def release(self, gpus: tuple[int, ...]) -> None:
        with self.cond:
            self.free |= set(gpus)
            self.cond.notify_all()

    def waiting(self) -> bool:
        """A request is blocked: idle servers should give their GPUs back."""
        with self.cond:
            return bool(self.queue)


class PortBook:
    """Ports handed to this process's servers, until their slot gives them back. free_port() holds a
    port (bound, not listening) until its server is up, which keeps other processes off it; this book
    keeps it off this process's other slots for as long as the server uses it, and lets the hold go
    when a slot gives back a port it never launched on (a wait for GPUs that was cancelled)."""

    def __init__(self):
        self.taken: set[int] = set()
        self.lock = threading.Lock()

    def reserve(self) -> int:
        with self.lock:
            port = free_port()
            while port in self.taken:
                port = free_port()
            self.taken.add(port)
            return port

    def release(self, port: int | None) -> None:
        with self.lock:
            self.taken.discard(port)
        release_port(port)


class Slot:
    """What one of the concurrent trial runners holds while its engine server runs: GPUs and a port.
    `Servers(p, slot=...)` asks for both before a launch and gives them back when it stops. `adapter`:
    the engine's, which says how many GPUs a config spans."""

    def __init__(self, pool: GpuPool, ports: PortBook, cancelled=lambda: False, *, adapter):
        self.pool, self.ports, self.cancelled, self.adapter = pool, ports, cancelled, adapter
        self.gpus: tuple[int, ...] = ()
        self.held_port: int | None = None

    def port(self) -> int:
        self.ports.release(self.held_port)
        self.held_port = self.ports.reserve()
        return self.held_port

    def acquire(self, config: dict) -> dict[str, str]:
        """GPUs for `config` (waits for them); the environment that confines the engine to them."""
        self.pool.release(self.gpus)
        self.gpus = ()
        self.gpus = self.pool.acquire(gpus_needed(config, bool(self.pool.gpus), self.adapter), self.cancelled)
        return visible_devices(self.gpus)

    def release(self) -> None:
        self.pool.release(self.gpus)
        self.ports.release(self.held_port)
        self.gpus, self.held_port = (), None
