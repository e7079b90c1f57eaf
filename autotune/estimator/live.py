"""The live embedded server that collection and evaluation measure on: launch it, the requests sent to
it, one request, the text its model sees, a progress bar."""
import dataclasses
import json
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.bench import load_workload
from autotune.embedded.config import EngineConfig
from autotune.engines.embedded import EmbeddedAdapter
from autotune.engines.launcher import Launcher, launch

DEFAULT_CONFIG = {"drafter": "ngram", "draft_length": 4}  # the server measured where no study or file names one
START_TIMEOUT_S = 300


def serve(config: dict, log_dir: Path) -> Launcher:
    """An embedded server with `config` (its "model" and "draft_model": the checkpoints), healthy; leaving `with` stops it.
    Raises LaunchError."""
    settings = {k: v for k, v in config.items() if k not in ("model", "draft_model")}
    return launch(EmbeddedAdapter(), settings, model=config.get("model"), draft_model=config.get("draft_model"),
                  log_path=log_dir / "server.log", timeout_s=START_TIMEOUT_S)


def measurable(config: dict) -> bool:
    """Whether a setup runs on the embedded engine (collection and evaluation measure there): a study of
    another engine hands its rows to the fit, but nothing can be collected or evaluated for it here."""
    return set(config) <= {f.name for f in dataclasses.fields(EngineConfig)}


def send(client, url: str, request: dict, **extra) -> dict:
    """One request, non-streamed: its usage, text and wall seconds."""
    body = {k: v for k, v in request.items() if k != "api"} | extra
    path = "/v1/chat/completions" if request["api"] == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    response = client.post(url + path, json=body)
    seconds = time.perf_counter() - t0
    response.raise_for_status()
    doc = response.json()
    choice = doc["choices"][0]
    text = choice["message"]["content"] if request["api"] == "chat" else choice["text"]
    return {**doc["usage"], "output": text, "seconds": seconds}


def requests_of(workloads: list[str], *, exclude: list[dict] = (), max_tokens: int, temperatures=None) -> list[dict]:
    """Shipped or file workloads as request bodies (minus `exclude`'s prompts), capped at max_tokens;
    temperatures, when given, are assigned round robin (the shipped code/chat/repetitive sets are greedy only)."""
    seen = {json.dumps(r.get("messages") or r.get("prompt")) for r in exclude}
    out = []
    for name in workloads:
        for r in load_workload(name).requests:
            if json.dumps(r.get("messages") or r.get("prompt")) not in seen:
                out.append(dict(r, max_tokens=min(r.get("max_tokens", max_tokens), max_tokens), ignore_eos=True))
    for i, r in enumerate(out):
        if temperatures:
            r["temperature"] = temperatures[i % len(temperatures)]
        r.setdefault("temperature", 1.0)
        r["seed"] = i
    return out


def chat_renderer(model: str | None):
    """messages -> the text the embedded engine's model sees (its chat template), from the checkpoint's metadata."""
    return EmbeddedAdapter().tokenizer(model).apply_chat_template


def progress(total: int, label: str):
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True)
    return bar, bar.add_task(label, total=total)


def announce(bar: Progress, label: str, requests: int) -> None:
    """A line before the server's launch (and compile), which the bar cannot count: also when not a terminal."""
    bar.console.print(f"{label}: launching the embedded server, then {requests} requests one at a time", highlight=False)
