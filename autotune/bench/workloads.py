"""Workloads: lists of OpenAI request bodies, from the shipped sets, a user JSONL file or ShareGPT JSON."""
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from autotune import package_path

SHIPPED = package_path("bench", "workloads")
APIS = ("chat", "completions")
SHAREGPT_MAX_TOKENS = 1024  # cap on a ShareGPT reply's length, as output budget


@dataclass
class Workload:
    name: str
    requests: list[dict]  # OpenAI body fields plus "api": chat | completions

    def describe(self) -> dict:
        """Prompt and output lengths (characters and requested max_tokens) of this workload."""
        prompt_chars = [len(prompt_text(r)) for r in self.requests]
        max_tokens = [r["max_tokens"] for r in self.requests if "max_tokens" in r]
        return {"name": self.name, "requests": len(self.requests),
                "apis": {api: sum(r["api"] == api for r in self.requests) for api in APIS},
                "prompt_chars_mean": round(statistics.fmean(prompt_chars), 1),
                "prompt_chars_min": min(prompt_chars), "prompt_chars_max": max(prompt_chars),
                "max_tokens_mean": round(statistics.fmean(max_tokens), 1) if max_tokens else None,
                "max_tokens_max": max(max_tokens, default=None),
                "temperatures": sorted({float(r.get("temperature", 1.0)) for r in self.requests})}


def shipped_workloads() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.jsonl"))


def prompt_text(request: dict) -> str:
    if request["api"] == "completions":
        return request["prompt"] if isinstance(request["prompt"], str) else json.dumps(request["prompt"])
    return "\n".join(m["content"] if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
                     for m in request["messages"])


def load_workload(name_or_path: str, seed: int = 0) -> Workload:
    """A shipped set by name, or a .jsonl of OpenAI bodies, or a ShareGPT .json; order shuffled by seed.

    Raises ValueError with a one-line reason on anything it cannot use.
    """
    path = Path(name_or_path)
    if not path.exists() and (SHIPPED / f"{name_or_path}.jsonl").exists():
        path = SHIPPED / f"{name_or_path}.jsonl"
    if not path.exists():
        raise ValueError(f"workload {name_or_path!r} is neither a file nor a shipped set "
                         f"({', '.join(shipped_workloads())})")
    requests = read_sharegpt(path) if path.suffix == ".json" else read_jsonl(path)
    if not requests:
        raise ValueError(f"workload {path} holds no requests")
    random.Random(seed).shuffle(requests)
    return Workload(name=path.stem, requests=requests)


def read_jsonl(path: Path) -> list[dict]:
    requests = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(body, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object (an OpenAI request body)")  # noqa: TRY004
        requests.append(checked_body(body, f"{path}:{n}"))
    return requests


def checked_body(body: dict, where: str) -> dict:
    body = dict(body)
    body.pop("stream", None)  # the client always streams
    api = body.setdefault("api", "chat" if "messages" in body else "completions")
    if api not in APIS:
        raise ValueError(f"{where}: api must be one of {', '.join(APIS)}, not {api!r}")
    needed = "messages" if api == "chat" else "prompt"
    if needed not in body:
        raise ValueError(f"{where}: a {api} request needs {needed!r}")
    if api == "chat" and (not isinstance(body["messages"], list) or not body["messages"]):
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for key in ("max_tokens", "temperature", "top_p"):
        if key in body and not isinstance(body[key], (int, float)):
            raise ValueError(f"{where}: {key!r} must be a number")
    return body


def read_sharegpt(path: Path) -> list[dict]:
    """ShareGPT: the first human turn is the prompt; the first reply's length (chars/4) the output budget."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a ShareGPT list of {{'conversations': [...]}}")  # noqa: TRY004
    requests = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not turns or len(turns) < 2 or not all(isinstance(t, dict) and "value" in t for t in turns[:2]):
            continue  # as sglang/vLLM do: skip conversations without a prompt and a reply
        reply_tokens = min(SHAREGPT_MAX_TOKENS, max(4, len(turns[1]["value"]) // 4))
        requests.append({"api": "chat", "messages": [{"role": "user", "content": turns[0]["value"]}],
                         "max_tokens": reply_tokens, "temperature": 0.0})
    return requests


def with_api(workload: Workload, api: str) -> Workload:
    """The same requests sent through the other endpoint: chat turns joined as a raw prompt, or a prompt as one user turn."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, not {api!r}")
    converted = []
    for r in workload.requests:
        r = dict(r)
        if r["api"] != api:
            if api == "chat":
                r["messages"] = [{"role": "user", "content": prompt_text(r)}]
                r.pop("prompt")
            else:
                r["prompt"] = prompt_text(r)
                r.pop("messages")
            r["api"] = api
        converted.append(r)
    return Workload(workload.name, converted)
