"""Shared fixtures: a live embedded engine (`autotune serve`), started by the launcher the study uses.

`embedded_server`        session-wide server (bundled SmolLM2-135M, ngram drafter); yields its base URL
`start_embedded_server`  factory for tests that need other flags: start_embedded_server(drafter="none",
                         verify_slots=1) -> EmbeddedServer (.url, .proc, .stop() -> exit code, .log());
                         stopped at the end of the test
`exported_server(script, log, startup_s)`  an exported best/launch.sh run as a user runs it, on a free port, until
                         it answers /health: (process, base URL); its process group is stopped on exit
"""
import contextlib
import importlib.util
import os
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from autotune.engines import get_adapter
from autotune.engines.launcher import Launcher, LaunchError, free_port, launch

# Small context and few slots: a fast start and a small KV cache; ngram drafting so acceptance moves.
SESSION_SERVER_FLAGS = {"drafter": "ngram", "draft_length": 4, "verify_slots": 4, "max_seq_len": 1024}
EMBEDDED = get_adapter("embedded")
STARTUP_TIMEOUT_S = 180


def plain_bind(port: int) -> int:
    """0 when a socket without SO_REUSEADDR (what most programs open) can bind the port, else the errno."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return 0
        except OSError as e:
            return e.errno


def serve_options(flags: dict) -> dict:
    """launch()'s arguments for `autotune serve` with `flags` (its options as keywords): engine settings as the
    config the study passes, the model paths as its model arguments, other serve options (--request-timeout) as
    extra arguments."""
    keys = EMBEDDED.config_keys()
    config = {name: value for name, value in flags.items() if name in keys}
    model, draft_model = config.pop("model", None), config.pop("draft_model", None)
    extra = [arg for name, value in flags.items() if name not in keys and value is not None
             for arg in (f"--{name.replace('_', '-')}", str(value))]
    return {"config": config, "model": model, "draft_model": draft_model, "extra_args": extra}


def serve_argv(port: int, flags: dict) -> list[str]:
    """`autotune serve` with `flags` on 127.0.0.1:port, as the embedded adapter writes it."""
    options = serve_options(flags)
    return EMBEDDED.command(options.pop("config"), host="127.0.0.1", port=port, **options)[0]


class EmbeddedServer:
    """`autotune serve` brought up by the launcher the study, validation and ci use (launcher.launch: the port
    held until the server is up, its own process group, a LaunchError saying why it did not come up), so a
    launcher bug fails these tests too; its output in a temporary log file."""

    def __init__(self, **flags):
        fd, self.log_path = tempfile.mkstemp(prefix="autotune-serve-", suffix=".log")
        os.close(fd)
        try:
            self.server = launch(EMBEDDED, **serve_options(flags), log_path=self.log_path,
                                 timeout_s=STARTUP_TIMEOUT_S)
        except LaunchError as e:
            e.add_note(e.log_tail)  # the server's own last lines in the test's report
            raise
        self.url, self.port = self.server.base_url, self.server.port

    @property
    def proc(self) -> subprocess.Popen:
        return self.server.proc

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM to the process group (SIGKILL for what is left after `timeout`); the server's exit code."""
        return self.server.stop(grace_s=timeout)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def exported_server(script, log, startup_s: float = STARTUP_TIMEOUT_S):
    """`bash launch.sh` with HOST and PORT set, as a user runs it, through the launcher; yields (process, base URL)
    once it is healthy."""
    port = free_port()  # held (not listening) until the script's server is up: Launcher.start lets it go
    url = f"http://127.0.0.1:{port}"
    with Launcher(["bash", str(script)], env={"PORT": str(port), "HOST": "127.0.0.1"}, log_path=log,
                  health_url=url + "/health") as server:
        server.start(timeout=startup_s)
        yield server.proc, url


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
    from autotune.embedded.weights import load_model

    # by its path: pytest puts tests/embedded on sys.path only once it collects that folder (a run of
    # tests/study alone did not)
    spec = importlib.util.spec_from_file_location("tiny_checkpoints", Path(__file__).parent / "embedded" /
                                                  "test_embedded_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    write_tiny_checkpoint = module.write_tiny_checkpoint

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
