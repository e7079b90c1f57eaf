"""Run an engine server as a real subprocess: start, wait until ready, classify failures, stop.

The server gets its own process group (engines fork workers: tokenizer, detokenizer, TP ranks), so
stopping it signals the whole group: SIGTERM (and SIGCONT: a stopped process acts on SIGTERM only once
continued), a grace period, then SIGKILL; `kill()` is SIGKILL at once, for a server that hangs. Never a
shell: argv goes straight to exec. Output goes to one log file per launch, which is also what failures
are read from.

Ports: `free_port()` keeps the port it picks bound (not listening) in this process until the server
meant for it is up, so no other process's bind(0) or outgoing connection can take it in between (a
per-process list could not stop another tuner, or another test run, on the same machine). Servers
bind with SO_REUSEADDR or SO_REUSEPORT (uvicorn, http.server, cpp-httplib, PostgreSQL all do), which
such a held port allows. A server that binds without it, or a port someone else took, ends in "address already in
use": the launcher gives the port up and launches again.
"""
import ctypes
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

# Out of memory, whichever layer noticed: CUDA, the torch allocator, the C library, the kernel.
OOM_PATTERNS = re.compile(
    r"CUDA out of memory|OutOfMemoryError|out of memory|Cannot allocate memory|std::bad_alloc|"
    r"^Killed\s*$|MemoryError", re.IGNORECASE | re.MULTILINE)
KILLED_EXIT_CODES = (-signal.SIGKILL, 128 + signal.SIGKILL)  # the kernel OOM killer's signature
# The port was taken: Python (uvicorn, vLLM, SGLang), C (strerror), cpp-httplib (llama.cpp), Rust (TGI).
ADDRESS_IN_USE = re.compile(r"address already in use|EADDRINUSE|\[Errno 98\]|couldn't bind|could not bind|"
                            r"os error 98", re.IGNORECASE)
PORT_RETRIES = 2  # launches again after "address already in use", with the port given up by this process
REASON_BYTES = 256 * 1024  # of a launch's output, searched for why it exited (a root cause precedes its tracebacks)
HOLD_MAX_S = 3600.0  # a held port nobody launched on is given up after this long (no descriptor leak)


# Why a server refused to start, as engines say it: a Python exception line ("ValueError: ...", perhaps behind a log
# prefix such as vLLM's "(VllmWorker-0 pid=7) ERROR 12-03 09:26:55 [file.py:953] "), or argparse's "prog: error: ...".
EXCEPTION_LINE = re.compile(r"^(?:.*?\] |\([\w-]+ pid=\d+\) )?(?:[A-Za-z_]\w*\.)*((\w*(?:Error|Exception)): .+)$")
ARGPARSE_LINE = re.compile(r"^\S+: error: .+$")
# An exception that only points at another (vLLM: "Engine core initialization failed. See root cause above.")
WRAPPER = re.compile(r"root cause|see (the )?(stack trace|above)", re.IGNORECASE)


def reason(output: str) -> str:
    """One line: why the process whose output this is exited. Its last exception or argparse error that is not a
    wrapper pointing at another (vLLM's start-up wraps its root cause twice), with the first field and message of a
    pydantic ValidationError (what vLLM raises for a bad setting); else the last line."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip()]
    found = []  # (line index, text, exception name) of every exception or argparse line
    for i, line in enumerate(lines):
        if ARGPARSE_LINE.match(line):
            found.append((i, line, None))
        elif match := EXCEPTION_LINE.match(line):
            found.append((i, match.group(1), match.group(2)))
    if not found:
        return lines[-1].strip() if lines else "no output"
    i, text, name = next((f for f in reversed(found) if not WRAPPER.search(f[1])), found[-1])
    detail = lines[i + 1:i + 3]
    if name == "ValidationError" and len(detail) == 2 and detail[1].startswith(" "):
        text += f" {detail[0].strip()}: {detail[1].strip().split(' [type=')[0]}"
    return text


class LaunchError(Exception):
    """A server that did not come up (or died): kind is "oom", "crash" or "timeout"."""

    def __init__(self, kind: str, message: str, log_tail: str = "", argv: list[str] | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.log_tail, self.argv = kind, message, log_tail, argv


_held: dict[int, tuple[socket.socket, float]] = {}  # port -> (its bound socket, when it was picked)
_held_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on (the OS picks it), held by this process until `release_port(port)`:
    a Launcher whose health URL names the port releases it once its server is up, or has failed."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the server's own SO_REUSEADDR bind may share it
    if hasattr(socket, "SO_REUSEPORT"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # so may a SO_REUSEPORT one (cpp-httplib)
    s.bind((host, 0))
    port = s.getsockname()[1]
    with _held_lock:
        now = time.monotonic()
        for stale in [p for p, (_, since) in _held.items() if now - since > HOLD_MAX_S]:
            _held.pop(stale)[0].close()
        _held[port] = (s, now)
    return port


def release_port(port: int | None) -> bool:
    """Stop holding a port free_port() gave (its server listens now, or never will); False if not held."""
    with _held_lock:
        entry = _held.pop(port, None)
    if entry is None:
        return False
    entry[0].close()
    return True


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
        self._log_start = 0  # where the current launch's output starts in the log

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def port(self) -> int | None:
        """The port the health URL names (the one the server is to listen on)."""
        try:
            return urlsplit(self.health_url).port
        except ValueError:
            return None

    def start(self, timeout: float = 600.0, poll_s: float = 0.25) -> None:
        """Launch and wait for health; a server that exits with "address already in use" is launched
        again (PORT_RETRIES times) once this process has let go of the port (free_port holds it)."""
        deadline = time.monotonic() + timeout
        try:
            for attempt in range(PORT_RETRIES + 1):
                log_start = self._spawn()
                try:
                    return self._wait_ready(deadline, timeout, poll_s)
                except LaunchError as failure:
                    if failure.kind != "crash" or not ADDRESS_IN_USE.search(self._log_since(log_start)):
                        raise
                    self.stop()  # whatever the dead server had forked
                    released = release_port(self.port)
                    if attempt == PORT_RETRIES:
                        raise LaunchError("crash", f"port {self.port} already in use ({attempt + 1} launches): "
                                          f"{failure.message}", failure.log_tail, self.argv) from None
                    if not released:
                        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # someone else's: it may go
        finally:
            release_port(self.port)  # the server listens now (or never will): nothing left to hold

    def _spawn(self) -> int:
        """Start the process; the log's size before this launch (its output starts there)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._stopping = False
        with open(self.log_path, "ab") as log:
            start = self._log_start = log.tell()
            log.write(f"$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.env}, cwd=self.cwd, start_new_session=True,
                                             preexec_fn=_die_with_parent)  # noqa: PLW1509 - one prctl call
            except OSError as e:  # no such executable, not executable, ...
                raise LaunchError("crash", f"cannot start {self.argv[0]}: {e}", argv=self.argv) from None
        return start

    def _wait_ready(self, deadline: float, timeout: float, poll_s: float) -> None:
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

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def failure(self) -> LaunchError | None:
        """Why the server exited (None while it runs, or when it was stopped on purpose)."""
        if self.proc is None or self.proc.poll() is None or self._stopping:
            return None
        code, tail = self.proc.returncode, self.log_tail()
        if code in KILLED_EXIT_CODES or OOM_PATTERNS.search(tail):
            return LaunchError("oom", f"out of memory (exit {code})", tail, self.argv)
        said = reason(self._log_since(self._log_start)[-REASON_BYTES:])
        return LaunchError("crash", f"exited with code {code}: {said[:300]}", tail, self.argv)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to grace_s, then SIGKILL whatever is left; the exit code."""
        if self.proc is None:
            return None
        self._stopping = True
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        _signal_group(pgid, signal.SIGTERM)
        _signal_group(pgid, signal.SIGCONT)  # a stopped (SIGSTOP, SIGTSTP) process would not see the SIGTERM
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(pgid)):
            time.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)  # stragglers that ignored SIGTERM (or outlived the leader)
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): report, do not hang the study
            return None

    def kill(self) -> int | None:
        """SIGKILL the process group now (it also ends stopped processes); the exit code."""
        if self.proc is None:
            return None
        self._stopping = True
        _signal_group(self.proc.pid, signal.SIGKILL)
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


def at_address(argv: list[str], host: str, port: int) -> list[str]:
    """A stored command (an exported launch) bound to host:port."""
    out = list(argv)
    for flag, value in (("--host", host), ("--port", str(port))):
        if flag in out[:-1]:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def launch(adapter, config: dict | None = None, *, argv: list[str] | None = None, model: str | None = None,
           draft_model: str | None = None, env: dict[str, str] | None = None, log_path: str | Path,
           timeout_s: float, host: str = "127.0.0.1", port: int | None = None,
           extra_args: list[str] = ()) -> Launcher:
    """Start an engine server and return it once healthy (raises LaunchError): `config` through the
    adapter's command, or a stored `argv` moved to this address; `extra_args` (server options that are no
    config setting) follow either. What the tuner, validation, ci and the estimator's data collection all do
    to bring up a server, and the tests' embedded servers (tests/conftest.py)."""
    port = port or free_port(host)
    if argv is None:
        argv, engine_env = adapter.command(config or {}, model=model, draft_model=draft_model, host=host, port=port,
                                           extra_args=list(extra_args))
    else:
        argv, engine_env = at_address([*argv, *extra_args], host, port), {}
    base = f"http://{host}:{port}"
    server = Launcher(argv, env={**engine_env, **(env or {})}, log_path=log_path,
                      health_url=adapter.health_url(base), base_url=base)
    server.start(timeout=timeout_s)
    return server
