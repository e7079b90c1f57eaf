"""The data the estimator fits on: one row per measured request, from a study or measured here.

A row: the prompt the model saw (text), temperature, top_p, the engine's prompt_entropy, and the
request's verify steps, proposed, accepted and rejected tokens, draft and verify seconds. Sources: a
study's `requests/trial-N.parquet` (study_rows), or a collection pass against a live embedded server
at several fixed k (collect).
"""
import json
from itertools import zip_longest
from pathlib import Path

import httpx
import pandas as pd

from autotune.bench import load_workload
from autotune.estimator.live import announce, chat_renderer, progress, requests_of, send, serve

RUNTIME = ("draft_length", "draft_policy")  # knobs that change k, not the drafter


def study_rows(study_dir: str | Path) -> tuple[pd.DataFrame, dict]:
    """The speculative rows of a study's requests/trial-N.parquet of its most measured drafter setup, and that setup,
    plus, as k = 0 rows, the plain requests of the plain setup nearest it (most knobs in common): what a step
    costs without proposals, which an engine that reports no draft/verify times (llama-server) leaves the cost
    fit no other way to learn when its drafter ran at one k.

    Raises ValueError when the study holds no per-request data with speculation."""
    files = sorted(Path(study_dir, "requests").glob("trial-*.parquet"))
    if not files:
        raise ValueError(f"{study_dir} has no per-request data (requests/trial-N.parquet)")
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    frame = frame[frame["ok"].astype(bool) & (frame["spec_verify_steps"].fillna(0) > 0)]
    if frame.empty or "config" not in frame:
        raise ValueError(f"{study_dir}: no request in its per-request data used speculative decoding")
    configs = frame["config"].map(json.loads)
    setups = configs.map(lambda c: json.dumps({k: v for k, v in sorted(c.items()) if k not in RUNTIME}))
    drafted = setups.isin(set(setups[frame["spec_draft_tokens"] > 0]))
    if not drafted.any():
        raise ValueError(f"{study_dir}: no request in its per-request data used speculative decoding")
    setup = setups[drafted].value_counts().index[0]
    chosen = json.loads(setup)
    plain = setups[~drafted].unique()
    nearest = max(plain, key=lambda s: sum(chosen.get(k) == v for k, v in json.loads(s).items()), default=None)
    keep = (setups == setup) | (setups == nearest)
    frame, configs = frame[keep], configs[keep]
    # H10's rows keep the user's text; the engine's features see the chat template around it
    render = chat_renderer(chosen.get("model")) if (frame["api"] == "chat").any() else None
    rows = frame.assign(
        text=[render([{"role": "user", "content": p}]) if api == "chat" else p for p, api in zip(frame["prompt"], frame["api"])],
        k=[c.get("draft_length", 4) if s == setup else 0 for c, s in zip(configs, setups[keep])])
    config = dict(chosen, draft_length=int(rows["k"][rows["k"] > 0].mode()[0]))
    return rows.reset_index(drop=True), config


def collect(config: dict, log_dir: Path, *, workloads=("code", "chat", "repetitive"), exclude: str = "mixed",
            ks=(0, 1, 2, 4, 8), temperatures=(0.0, 0.3, 0.7, 1.0), max_tokens: int = 48,
            limit: int | None = None, start: int = 0) -> pd.DataFrame:
    """Rows to fit on, measured here: the workloads' prompts (minus the held-out `exclude` set; the workloads
    interleaved, so `limit` takes from each; `start` skips that many, to extend an earlier pass) at
    temperatures round robin, each prompt run at every k in `ks` back to back in rotating order (paired: the
    same prompt at each k, minutes apart at most), one at a time on a fresh server. k = 0 rows (no
    speculation) anchor the cost model's step without proposals. Every request is traced (each proposed
    token's draft entropy, top-1 probability and acceptance: the stop rule's data, stop.py)."""
    held_out = load_workload(exclude).requests if exclude else []
    per_workload = [requests_of([name], exclude=held_out, max_tokens=max_tokens) for name in workloads]
    todo = [r for group in zip_longest(*per_workload) for r in group if r is not None]
    for i, r in enumerate(todo):
        r["temperature"], r["seed"], r["index"] = temperatures[i % len(temperatures)], i, i
    todo = todo[start:][:limit]
    render = chat_renderer(config.get("model"))
    rows = []
    bar, task = progress(len(todo) * len(ks), "collect")
    with bar:
        announce(bar, "collect", len(todo) * len(ks))
        with serve(config, log_dir) as server, httpx.Client(timeout=300) as client:
            for request in todo:
                i = request.pop("index")
                text = render(request["messages"]) if request["api"] == "chat" else request["prompt"]
                turn = i % len(ks)
                for k in ks[turn:] + ks[:turn]:
                    usage = send(client, server.base_url, request, draft_length=k, draft_trace=True)
                    usage["spec_draft_trace"] = json.dumps(usage.get("spec_draft_trace", []))  # parquet-safe
                    rows.append({**usage, "text": text, "temperature": request["temperature"],
                                 "top_p": request.get("top_p", 1.0), "k": k, "prompt_index": i})
                    bar.advance(task)
    return pd.DataFrame(rows)
