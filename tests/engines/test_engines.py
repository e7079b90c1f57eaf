"""Engine adapters (argv, schemas, rules, effective-config dedupe) and the launcher (real subprocesses)."""
import copy
import errno
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
from dataclasses import FrozenInstanceError, fields
from types import SimpleNamespace

import httpx
import pytest
from conftest import plain_bind

from autotune.engines import ENGINES, get_adapter
from autotune.engines import launcher as launcher_module
from autotune.engines.base import EngineAdapter
from autotune.engines.facts import EngineFacts
from autotune.engines.launcher import PORT_RETRIES, Launcher, LaunchError, free_port, release_port
from autotune.engines.protocol import EngineBehaviour
from autotune.space.space import load_space

SGLANG_CONFIG = {"tp_size": 2, "quantization": "w8a16_fp8", "speculative_algorithm": "EAGLE3",
                 "speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16,
                 "cuda_graph_bs_decode": [1, 2, 4, 8], "enable_torch_compile": True, "torch_compile_max_bs": 8,
                 "chunked_prefill_size": -1, "mem_fraction_static": 0.85, "attention_backend": "fa3", "page_size": 16}
VLLM_CONFIG = {"tensor_parallel_size": 2, "speculative_method": "ngram", "num_speculative_tokens": 4,
               "prompt_lookup_min": 2, "prompt_lookup_max": 4, "max_num_seqs": 64, "max_num_batched_tokens": 8192,
               "gpu_memory_utilization": 0.9, "cudagraph_capture_sizes": [1, 2, 4, 8], "kv_cache_dtype": "fp8",
               "enforce_eager": False}


def command(engine, config, **kw):
    return get_adapter(engine).command(config, model="/models/target", draft_model=kw.get("draft", "/models/draft"),
                                       host="127.0.0.1", port=30000)


# -- what an engine is ----------------------------------------------------------------------------------
@pytest.mark.parametrize("on_gpu", [True, False])
def test_every_engine_is_its_behaviour_and_one_frozen_facts_record(on_gpu):
    """An engine provides the behaviour protocol's methods (its own or the base's shared ones) and keeps its static
    facts in one frozen EngineFacts, readable only as adapter.facts.<name>: no fact stays an attribute of the adapter,
    and no reader can change one (speculation_off merged into a baseline, default_load filled into options)."""
    names = {f.name for f in fields(EngineFacts)}
    for engine in ENGINES:
        adapter = get_adapter(engine).for_target(on_gpu)
        assert isinstance(adapter, EngineBehaviour), engine
        assert isinstance(adapter.facts, EngineFacts), engine
        assert not [n for n in names if hasattr(adapter, n)], engine
        with pytest.raises(FrozenInstanceError):
            adapter.facts.numerics = ()
        with pytest.raises(TypeError):
            adapter.facts.default_load["concurrency"] = 1
        assert pickle.loads(pickle.dumps(adapter.facts)) == adapter.facts == copy.deepcopy(adapter.facts), engine
        assert adapter.facts.tp_key is None or adapter.facts.tp_key in adapter.facts.modelled, engine
        # every drafter the space offers is priced as one of predict's families (none left to a shared table)
        drafters = load_space(engine).params[adapter.facts.draft_keys[0]].choices
        assert set(drafters) - {"none", None} <= set(adapter.facts.drafter_families), engine
    assert not [n for n in names if hasattr(EngineAdapter, n)]  # the base keeps shared behaviour only
    with pytest.raises(ValueError, match="memory_pool"):  # a pool predict/memory.py has no rule for
        EngineFacts(memory_pool="paged")
    with pytest.raises(ValueError, match="medusa"):  # a family the speed model does not know
        EngineFacts(drafter_families={"MEDUSA": "medusa"})
    cpu, gpu = get_adapter("vllm").for_target(False).facts, get_adapter("vllm").for_target(True).facts
    assert cpu.default_load["concurrency"] < gpu.default_load["concurrency"] and "{version}" in gpu.image


# -- argv and flag schemas ----------------------------------------------------------------------------
def test_representative_commands_validate_against_captured_schemas():
    argv, env = command("sglang", SGLANG_CONFIG)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert env == {"SGLANG_FORCE_FP8_MARLIN": "1"} and argv[argv.index("--quantization") + 1] == "fp8"
    assert argv[argv.index("--cuda-graph-bs-decode") + 1:][:4] == ["1", "2", "4", "8"]
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "/models/draft"
    assert get_adapter("sglang").validate_flags(argv) == []

    argv, env = command("vllm", VLLM_CONFIG)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert "--enforce-eager" not in argv and get_adapter("vllm").validate_flags(argv) == []

    argv, _ = command("embedded", {"drafter": "ngram", "draft_length": 6, "cuda_graph_batch_sizes": [1, 2, 4]})
    assert argv[:4] == [sys.executable, "-m", "autotune.cli", "serve"]
    assert argv[argv.index("--cuda-graph-batch-sizes") + 1] == "1,2,4"
    assert get_adapter("embedded").validate_flags(argv) == []


def test_every_seed_of_the_shipped_spaces_is_valid():
    for engine in ("sglang", "vllm"):
        space, adapter = load_space(engine), get_adapter(engine)
        configs = [space.complete(seed) for seed in space.seed_configs()]
        for config in configs:
            assert adapter.check(config, has_draft_model=True) == [], (engine, config)
        # the captured schema, then the installed engine's own parser where there is one (once for all seeds)
        assert adapter.validate_many([command(engine, config)[0] for config in configs]) == [[]] * len(configs), engine


@pytest.mark.parametrize("engine, args, expected", [
    ("sglang", ["--tp-szie", "2"], "unknown flag --tp-szie for sglang 0.5.23 (did you mean --tp-size?)"),
    ("sglang", ["--attention-backend", "flashattn9"], "--attention-backend must be one of"),
    ("sglang", ["--mem-fraction-static", "lots"], "--mem-fraction-static takes a number, got 'lots'"),
    ("sglang", ["--enable-torch-compile", "yes"], "--enable-torch-compile takes no value"),
    ("vllm", ["--speculative-config", "{method: ngram}"], "--speculative-config takes a JSON value"),
    ("vllm", ["--max-num-batched-tokens", "8q"], "--max-num-batched-tokens takes an integer like 8192 or 8k"),
    ("embedded", ["--drafter", "medusa"], "--drafter must be one of none, ngram"),
])
def test_bad_flags_are_caught(engine, args, expected):
    errors = get_adapter(engine).validate_flags(args)
    assert len(errors) == 1 and errors[0].startswith(expected), errors


def test_renamed_flags_are_caught_and_translated():
    sglang = get_adapter("sglang")
    old = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/m", "--cuda-graph-max-bs", "32",
           "--disable-cuda-graph"]
    errors = sglang.validate_flags(old)
    assert len(errors) == 1 and errors[0].startswith("--cuda-graph-max-bs does not exist in sglang 0.5.23")
    new, notes = sglang.translate_renamed(old)
    assert new[:5] == old[:5] and len(notes) == 2
    assert new[5:] == ["--cuda-graph-max-bs-decode", "32", "--cuda-graph-backend-decode", "disabled",
                       "--cuda-graph-backend-prefill", "disabled"]
    assert sglang.validate_flags(new) == []

    vllm = get_adapter("vllm")
    old = ["--model", "/m", "--speculative-model", "[ngram]", "--num-speculative-tokens", "4",
           "--ngram-prompt-lookup-max", "4"]
    assert len(vllm.validate_flags(old)) == 3
    new, notes = vllm.translate_renamed(old)
    assert new[:2] == ["--model", "/m"] and new[2] == "--speculative-config" and len(notes) == 3
    assert json.loads(new[3]) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert vllm.validate_flags(new) == []


# -- cross-flag rules ----------------------------------------------------------------------------------
EAGLE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 4,
         "speculative_num_draft_tokens": 16}
RULES = [  # (engine, violating config, a good neighbour, words the violation must contain)
    ("sglang", {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}, EAGLE, "all together or not at all"),
    ("sglang", {**EAGLE, "speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 8},
     {**EAGLE, "speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 7}, "draft tree"),
    ("sglang", {"speculative_algorithm": "NGRAM", "attn_dp_size": 2}, {"speculative_algorithm": "NGRAM"}, "dp attention"),
    ("sglang", {"speculative_algorithm": "STANDALONE", "enable_dp_attention": True},
     {"speculative_algorithm": "STANDALONE"}, "dp attention"),
    ("sglang", {**EAGLE, "attention_backend": "trtllm_mha"},
     {**EAGLE, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4, "attention_backend": "trtllm_mha"},
     "trtllm_mha"),
    ("sglang", {**EAGLE, "page_size": 16, "attention_backend": "flashmla"}, {**EAGLE, "page_size": 16}, "page_size"),
    ("sglang", {"speculative_algorithm": "MEDUSA"}, {"speculative_algorithm": "NEXTN"}, "not one of"),
    ("sglang", {"mem_fraction_static": 1.2}, {"mem_fraction_static": 0.9}, "between 0 and 1"),
    ("sglang", {"chunked_prefill_size": 0}, {"chunked_prefill_size": -1}, "positive or -1"),
    ("vllm", {"speculative_method": "eagle"}, {"speculative_method": "eagle", "num_speculative_tokens": 3},
     "needs num_speculative_tokens"),
    ("vllm", {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 5},
     "prompt_lookup_min 5 must be <="),
    ("vllm", {"max_num_seqs": 256, "max_num_batched_tokens": 128}, {"max_num_seqs": 128, "max_num_batched_tokens": 128},
     "must be >= max_num_seqs"),
    ("vllm", {"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": 8},
     {"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": 4}, "must equal the largest"),
    ("vllm", {"speculative_method": "medusa"}, {"speculative_method": "mtp", "num_speculative_tokens": 1}, "not one of"),
    ("embedded", {"drafter": "ngram", "ngram_min": 4, "ngram_max": 2}, {"drafter": "ngram", "ngram_min": 2},
     "ngram_min <= ngram_max"),
    ("embedded", {"dtype": "float8"}, {"dtype": "bfloat16"}, "dtype must be one of"),
    ("embedded", {"quantization": "gguf", "dtype": "bfloat16"}, {"quantization": "gguf", "dtype": "float32"},
     "needs dtype float32"),
    ("embedded", {"drafter": "quantized_self", "quantization": "int8"}, {"drafter": "quantized_self"},
     "needs quantization none"),
]


@pytest.mark.parametrize("engine, bad, good, words", RULES)
def test_each_cross_flag_rule_fires_on_a_violation_only(engine, bad, good, words):
    adapter = get_adapter(engine)
    violations = adapter.check(bad)
    assert len(violations) == 1 and words in violations[0], violations
    assert adapter.check(good) == []


def test_draft_model_rule_fires_only_when_known_to_be_missing():
    for engine, config in (("sglang", EAGLE), ("vllm", {"speculative_method": "eagle3", "num_speculative_tokens": 3}),
                           ("embedded", {"drafter": "draft_model"})):
        adapter = get_adapter(engine)
        assert len(adapter.check(config, has_draft_model=False)) == 1
        assert adapter.check(config, has_draft_model=True) == [] and adapter.check(config) == []
    assert get_adapter("sglang").check({"speculative_algorithm": "NEXTN"}, has_draft_model=False) == []


# -- effective-config dedupe ------------------------------------------------------------------------
def test_configs_the_engine_runs_identically_are_one():
    sglang = get_adapter("sglang")
    chain = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1}
    # Seen with the real sglang 0.5.23 parser: topk 1, steps 3, 9 draft tokens runs with 4.
    assert sglang.effective({**chain, "speculative_num_draft_tokens": 9}) == \
        sglang.effective({**chain, "speculative_num_draft_tokens": 4})
    assert sglang.effective({**chain, "speculative_algorithm": "NEXTN", "speculative_num_draft_tokens": 4}) == \
        sglang.effective({**chain, "speculative_num_draft_tokens": 4})
    assert sglang.effective({"tp_size": 1, "quantization": "none", "torch_compile_max_bs": 8}) == sglang.effective({})
    assert sglang.effective({**chain, "speculative_num_draft_tokens": 4}) != \
        sglang.effective({**chain, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4})

    vllm = get_adapter("vllm")
    assert vllm.effective({"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}) == \
        vllm.effective({"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3,
                        "prompt_lookup_max": 3})
    assert vllm.effective({"enforce_eager": True, "cudagraph_capture_sizes": [1, 2]}) == vllm.effective(
        {"enforce_eager": True})

    embedded = get_adapter("embedded")
    assert embedded.effective({"drafter": "none", "draft_length": 7, "ngram_max": 6}) == embedded.effective({})
    assert embedded.effective({"drafter": "ngram", "draft_length": 7}) != embedded.effective({"drafter": "ngram"})


# -- the launcher, on real subprocesses ---------------------------------------------------------------
def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie only waits for its parent to reap it)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


SERVER = """
import http.server, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker, like engines fork
print("argv", sys.argv[1:], "worker-pid:", child.pid, flush=True)
time.sleep(float(sys.argv[2]))  # the behaviour under test: a server that loads for a while before it listens
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def worker_pid(log: str) -> int:
    return int(re.search(r"worker-pid: (\d+)", log).group(1))


def launcher(tmp_path, code, *args, name="trial-0.log"):
    port = free_port()
    argv = [sys.executable, "-c", code, str(port), *map(str, args)]
    return Launcher(argv, log_path=tmp_path / "logs" / name, health_url=f"http://127.0.0.1:{port}/health")


def test_launcher_waits_for_readiness_and_stops_the_whole_group(tmp_path):
    literal = "$(touch pwned); echo hi"  # reaches the program verbatim: no shell in between
    server = launcher(tmp_path, SERVER, 0.5, literal)
    server.start(timeout=30)
    assert server.alive() and httpx.get(server.health_url).status_code == 200
    log = server.log_path.read_text()
    child = worker_pid(log)
    assert repr(literal) in log and not (tmp_path / "pwned").exists()
    assert running(child)
    server.stop(grace_s=5)
    assert not running(server.proc.pid) and not running(child)


def test_launcher_kills_a_server_that_ignores_sigterm(tmp_path, monkeypatch):
    code = SERVER.replace("import http.server", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                                "import http.server")
    server = launcher(tmp_path, code, 0)
    server.start(timeout=30)
    # The grace period runs on a virtual clock that only the launcher's own waits advance, and the signals it
    # sends are recorded with that clock's reading: when SIGKILL follows SIGTERM is the launcher's arithmetic,
    # not this machine's speed. The processes and the signals are real.
    clock, sent = [0.0], []

    def sleep(seconds):
        clock[0] += seconds

    def signal_group(pgid, sig):
        sent.append((sig, clock[0]))
        real_signal_group(pgid, sig)

    real_signal_group = launcher_module._signal_group
    monkeypatch.setattr(launcher_module, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
    monkeypatch.setattr(launcher_module, "_signal_group", signal_group)
    assert server.stop(grace_s=1.0) == -9 and not running(server.proc.pid)
    assert [sig for sig, _ in sent] == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    assert sent[0][1] == sent[1][1] == 0.0  # SIGTERM (and SIGCONT for a stopped server) at once
    assert 1.0 <= sent[2][1] < 1.5  # SIGKILL once the grace is over: not before, and not at the default 10 s


@pytest.mark.parametrize("code, kind, words", [
    ("import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB'); sys.exit(1)",
     "oom", "out of memory"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "oom", "exit -9"),
    ("import sys; print('loading'); print('ValueError: bad --tp-size', file=sys.stderr); sys.exit(3)",
     "crash", "exited with code 3: ValueError: bad --tp-size"),
])
def test_launcher_classifies_startup_failures(tmp_path, code, kind, words):
    server = launcher(tmp_path, code)
    with pytest.raises(LaunchError) as failure:
        server.start(timeout=30)
    assert failure.value.kind == kind and words in failure.value.message
    assert failure.value.argv == server.argv and "$ " in server.log_path.read_text()


def test_launcher_times_out_and_leaves_nothing_running(tmp_path):
    # The fake would become ready only after ten minutes; the worker it forks first must go with it. A
    # busy machine may not even have started Python (and printed the worker's pid) within a short
    # timeout: then the same claim is checked with a longer one.
    for timeout in (1.5, 5, 20, 60):
        server = launcher(tmp_path, SERVER, 600, name=f"timeout-{timeout}.log")
        with pytest.raises(LaunchError) as failure:
            server.start(timeout=timeout)
        assert failure.value.kind == "timeout" and f"within {timeout:g} s" in failure.value.message
        assert not running(server.proc.pid)
        if "worker-pid:" in server.log_path.read_text():
            break
    assert not running(worker_pid(server.log_path.read_text()))


# -- ports: held from free_port() until the server listens; "address already in use" is launched again --
PLAIN_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
class Plain(http.server.HTTPServer):
    allow_reuse_address = False  # binds as a program that never sets SO_REUSEADDR
print("binding", flush=True)
Plain(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_free_port_is_held_until_its_server_listens(tmp_path):
    port = free_port()
    try:
        # Another process asking the OS for a free port never gets it, and nobody can bind it plainly.
        code = "import socket\nfor _ in range(3000):\n    s = socket.socket(); s.bind(('127.0.0.1', 0)); " \
               "print(s.getsockname()[1]); s.close()"
        others = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert str(port) not in others.stdout.split()
        assert plain_bind(port) == errno.EADDRINUSE
        # The server it was picked for binds it (SO_REUSEADDR, as http.server, uvicorn and engines do),
        # at the first launch; once it is up the launcher no longer holds the port.
        server = Launcher([sys.executable, "-c", SERVER, str(port), "0"], log_path=tmp_path / "held.log",
                          health_url=f"http://127.0.0.1:{port}/health")
        server.start(timeout=60)
        assert server.port == port and server.log_path.read_text().count("$ ") == 1
        assert not release_port(port)
        server.stop(grace_s=5)
    finally:
        release_port(port)


def test_launcher_launches_again_when_the_port_was_taken(tmp_path):
    # A server that binds without SO_REUSEADDR cannot share the held port: it dies with "address already
    # in use", the launcher lets the port go and launches it again, on the same port.
    port = free_port()
    server = Launcher([sys.executable, "-c", PLAIN_SERVER, str(port)], log_path=tmp_path / "plain.log",
                      health_url=f"http://127.0.0.1:{port}/health")
    server.start(timeout=60)
    try:
        assert httpx.get(server.health_url).status_code == 200
        log = server.log_path.read_text()
        assert log.count("$ ") == 2 and "Address already in use" in log
    finally:
        server.stop(grace_s=5)
    # A port another program listens on stays taken: a bounded number of launches, then a crash that says so.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        server = Launcher([sys.executable, "-c", PLAIN_SERVER, str(busy)], log_path=tmp_path / "busy.log",
                          health_url=f"http://127.0.0.1:{busy}/health")
        with pytest.raises(LaunchError) as failure:
            server.start(timeout=60)
    assert failure.value.kind == "crash" and f"port {busy} already in use" in failure.value.message
    assert server.log_path.read_text().count("$ ") == PORT_RETRIES + 1 and not server.alive()


@pytest.mark.slow
def test_launcher_runs_the_real_embedded_engine_and_reuses_it_for_runtime_knobs(tmp_path):
    adapter = get_adapter("embedded")
    port = free_port()
    argv, env = adapter.command({"drafter": "ngram", "draft_length": 3, "verify_slots": 2, "max_seq_len": 256},
                                model=None, draft_model=None, host="127.0.0.1", port=port)
    assert adapter.validate_flags(argv) == []
    base = f"http://127.0.0.1:{port}"
    with Launcher(argv, env=env, log_path=tmp_path / "logs" / "trial-1.log", health_url=adapter.health_url(base)) as server:
        server.start(timeout=180)
        adapter.apply_runtime(base, {"draft_length": 5, "ngram_max": 3})
        assert httpx.get(f"{base}/admin/runtime").json()["draft_length"] == 5
        with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
            adapter.apply_runtime(base, {"ngram_min": 4, "ngram_max": 2})
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        assert "autotune_spec_accepted_tokens_total" in httpx.get(f"{base}/metrics").text
    assert not running(server.proc.pid)
