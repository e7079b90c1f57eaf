"""Shared fixtures: a live embedded engine, started the way users start it (`autotune serve`).

`embedded_server`        session-wide server (bundled SmolLM2-135M, ngram drafter); yields its base URL
`start_embedded_server`  factory for tests that need other flags: start_embedded_server(drafter="none",
                         verify_slots=1) -> EmbeddedServer (.url, .proc, .stop() -> exit code, .log());
                         stopped at the end of the test
`exported_server(script, log, startup_s)`  an exported best/launch.sh run as a user runs it, on a free port, until
                         it answers /health: (process, base URL); its process group is stopped on exit
"""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from autotune.engines.launcher import free_port, release_port

# Small context and few slots: a fast start and a small KV cache; ngram drafting so acceptance moves.
SESSION_SERVER_FLAGS = {"drafter": "ngram", "draft_length": 4, "verify_slots": 4, "max_seq_len": 1024}
STARTUP_TIMEOUT_S = 180


def plain_bind(port: int) -> int:
    """0 when a socket without SO_REUSEADDR (what most programs open) can bind the port, else the errno."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return 0
        except OSError as e:
            return e.errno


def serve_argv(port: int, flags: dict) -> list[str]:
    argv = [sys.executable, "-m", "autotune.cli", "serve", "--port", str(port)]
    for name, value in flags.items():
        if value is not None:
            value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


class EmbeddedServer:
    """`autotune serve` in its own process group, its output in a temporary log file."""

    def __init__(self, **flags):
        self.port = free_port()  # held until the server is up: no other test process can take it meanwhile
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="autotune-serve-", suffix=".log")
        with os.fdopen(fd, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(serve_argv(self.port, flags), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        finally:
            release_port(self.port)

    def _wait_ready(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"autotune serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"autotune serve not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to the process group (SIGKILL if it hangs); the server's exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def exported_server(script, log, startup_s: float = STARTUP_TIMEOUT_S):
    """`bash launch.sh` with HOST and PORT set, as a user runs it; yields (process, base URL) once it is healthy."""
    port = free_port()  # held (not listening) until the script's server is up
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PORT": str(port), "HOST": "127.0.0.1"})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            deadline = time.monotonic() + startup_s
            while True:
                assert proc.poll() is None, Path(log).read_text(errors="replace")[-3000:]
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"not healthy within {startup_s} s"
                time.sleep(0.25)  # a poll interval: the loop waits on /health answering
        finally:
            release_port(port)
        yield proc, url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """An engine built in this process with `threads` sets torch's thread count for the whole process; the next
    test (the ci fingerprint records it) sees the process's own count again."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def embedded_server():
    server = EmbeddedServer(**SESSION_SERVER_FLAGS)
    yield server.url
    server.stop()
    os.unlink(server.log_path)


@pytest.fixture
def start_embedded_server():
    servers = []

    def start(**flags) -> EmbeddedServer:
        servers.append(EmbeddedServer(**flags))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
        os.unlink(server.log_path)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer model with the bundled tokenizer: compiling it takes seconds, not minutes."""
    from test_embedded_model import write_tiny_checkpoint

    from autotune.embedded.weights import load_model

    directory = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(directory, "llama", load_model().tokenizer)
    return str(directory)


def write_gguf(path, arch: str, file_type=None, embedding_shape=(8, 4)):
    """A GGUF file of `arch` holding one F16 token embedding, with general.file_type `file_type` (a
    gguf.LlamaFileType, as convert_hf_to_gguf.py and llama-quantize write one) or none (as
    scripts/distill_draft_model.py writes its draft)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_tensor("token_embd.weight", np.zeros(embedding_shape, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
