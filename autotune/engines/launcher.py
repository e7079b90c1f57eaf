"""Run an engine server as a real subprocess: start, wait until ready, classify failures, stop.

The server gets its own process group (engines fork workers: tokenizer, detokenizer, TP ranks), so
stopping it signals the whole group: SIGTERM, a grace period, then SIGKILL. Never a shell: argv goes
straight to exec. Output goes to one log file per launch, which is also what failures are read from.
"""
import ctypes
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Out of memory, whichever layer noticed: CUDA, the torch allocator, the C library, the kernel.
OOM_PATTERNS = re.compile(
    r"CUDA out of memory|OutOfMemoryError|out of memory|Cannot allocate memory|std::bad_alloc|"
    r"^Killed\s*$|MemoryError", re.IGNORECASE | re.MULTILINE)
KILLED_EXIT_CODES = (-signal.SIGKILL, 128 + signal.SIGKILL)  # the kernel OOM killer's signature


class LaunchError(Exception):
    """A server that did not come up (or died): kind is "oom", "crash" or "timeout"."""

    def __init__(self, kind: str, message: str, log_tail: str = "", argv: list[str] | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.log_tail, self.argv = kind, message, log_tail, argv


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Launcher:
    """One server process: `start()` returns once `health_url` answers 200, else raises LaunchError."""

    def __init__(self, argv: list[str], *, log_path: str | Path, health_url: str, env: dict[str, str] | None = None,
                 base_url: str | None = None, cwd: str | Path | None = None):
        self.argv = [str(a) for a in argv]
        self.env = dict(env or {})  # added to this process's environment
        self.log_path = Path(log_path)
        self.health_url = health_url
        self.base_url = base_url or health_url.rsplit("/", 1)[0]
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout: float = 600.0, poll_s: float = 0.25) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.env}, cwd=self.cwd, start_new_session=True,
                                             preexec_fn=_die_with_parent)  # noqa: PLW1509 - one prctl call
            except OSError as e:  # no such executable, not executable, ...
                raise LaunchError("crash", f"cannot start {self.argv[0]}: {e}", argv=self.argv) from None
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                failure = self.failure()
                if failure is not None:
                    raise failure
                try:
                    if client.get(self.health_url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise LaunchError("timeout", f"not ready at {self.health_url} within {timeout:g} s",
                                      self.log_tail(), self.argv)
                time.sleep(poll_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def failure(self) -> LaunchError | None:
        """Why the server exited (None while it runs, or when it was stopped on purpose)."""
        if self.proc is None or self.proc.poll() is None or self._stopping:
            return None
        code, tail = self.proc.returncode, self.log_tail()
        if code in KILLED_EXIT_CODES or OOM_PATTERNS.search(tail):
            return LaunchError("oom", f"out of memory (exit {code})", tail, self.argv)
        last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "no output")
        return LaunchError("crash", f"exited with code {code}: {last.strip()[:300]}", tail, self.argv)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to grace_s, then SIGKILL whatever is left; the exit code."""
        if self.proc is None:
            return None
        self._stopping = True
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(pgid)):
            time.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)  # stragglers that ignored SIGTERM (or outlived the leader)
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): report, do not hang the study
            return None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the group (zombies wait for a reaper, they hold nothing)."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # no /proc: ask the kernel about the group as a whole
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# Looked up once here: the child runs only this call between fork and exec (no dlopen, no locks).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent():
    """In the child before exec: a tuner killed with SIGKILL must not leave its engine holding the GPU.

    Linux sends the signal when the launching *thread* ends: launch from a thread that outlives the server.
    """
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
