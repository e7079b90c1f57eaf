"""Greedy outputs against the baseline's: the same prompts decoded greedily one at a time, compared token by
token (identical prompts, identical-token share, first divergence per prompt). Reported, not judged: with
the baseline's numerics, greedy verification reproduces plain decoding exactly in float32 on a CPU, while
on a GPU a wider verify batch runs other kernels, whose rounding can change a near-tie (bf16 most of all).
"""
from __future__ import annotations

import httpx

from autotune.bench.client import ENDPOINTS
from autotune.bench.runner import served_model
from autotune.study.storage import StudyContext


def greedy_outputs(base_url: str, prompts: list[dict], max_tokens: int) -> list[dict]:
    """The greedy completion of each prompt, one at a time (no batching effects): {text, tokens}.
    The OpenAI API returns text; with the token count beside it, equal text and equal count is the
    token-for-token check the API allows."""
    model, out = served_model(base_url), []
    with httpx.Client(timeout=300) as client:
        for request in prompts:
            body = {k: v for k, v in request.items() if k not in ("api", "stream", "stream_options", "top_p", "top_k")}
            body.update(model=model, temperature=0.0, max_tokens=max_tokens, stream=False, seed=0)
            r = client.post(base_url + ENDPOINTS[request["api"]], json=body)
            r.raise_for_status()
            reply = r.json()
            choice = reply["choices"][0]
            text = choice["message"]["content"] if request["api"] == "chat" else choice["text"]
            out.append({"text": text, "tokens": (reply.get("usage") or {}).get("completion_tokens")})
    return out


def output_divergence(baseline: dict, candidate: dict) -> dict | None:
    d = first_divergence(baseline["text"], candidate["text"])
    if d is None and baseline["tokens"] != candidate["tokens"]:
        n = len(baseline["text"])
        d = {"char": n, "word": len(baseline["text"].split()), "baseline": f"{baseline['tokens']} tokens",
             "candidate": f"{candidate['tokens']} tokens (same text)"}
    return d


def first_divergence(baseline: str, candidate: str, context: int = 40) -> dict | None:
    """Where two outputs part: character offset, word number and the text around it on each side."""
    if baseline == candidate:
        return None
    i = next((n for n, (a, b) in enumerate(zip(baseline, candidate)) if a != b), min(len(baseline), len(candidate)))
    return {"char": i, "word": len(baseline[:i].split()),
            "baseline": baseline[max(0, i - context):i + context], "candidate": candidate[max(0, i - context):i + context]}


def agreement(reference: list[dict], outputs: list[dict], encode=None) -> dict:
    """How far each greedy output agrees with the baseline's, token by token: per prompt whether it is
    identical, the first position where they part (None: identical) and how many of the baseline's tokens
    came before it; the identical-token share is those over all the baseline's tokens. Tokens are the texts
    re-encoded with the model's tokenizer (`encode`), else characters."""
    split = encode or list
    per_prompt = []
    for i, (a, b) in enumerate(zip(reference, outputs)):
        ta, tb = split(a["text"]), split(b["text"])
        part = next((n for n, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        identical = output_divergence(a, b) is None
        per_prompt.append({"prompt": i, "identical": identical, "first_divergence": None if identical else part,
                           "baseline_tokens": len(ta), "agreeing_tokens": len(ta) if identical else min(part, len(ta))})
    total = sum(p["baseline_tokens"] for p in per_prompt)
    return {"unit": "token" if encode else "character",
            "identical_share": sum(p["agreeing_tokens"] for p in per_prompt) / total if total else 1.0,
            "per_prompt": per_prompt}


def quality(ctx: StudyContext, config: dict, base: dict, outputs: list[dict], reference: list[dict] | None,
            encode=None) -> dict:
    """The candidate's greedy outputs against the baseline's: identical prompts, token agreement, the first
    divergence. `mode` exact: its numerics (dtype, quantization, ...) are the baseline's, so only speculation
    differs; lossy: they differ, and so may the outputs."""
    knobs = ctx.adapter.facts.numerics
    changed = {k: config.get(k) for k in knobs if config.get(k) != base.get(k)}
    mode = "lossy" if changed else "exact"
    if reference is None:
        return {"mode": mode, "checked": False, "note": "baseline outputs unavailable"}
    diverged = [(i, d) for i, (a, b) in enumerate(zip(reference, outputs)) if (d := output_divergence(a, b))]
    out = {"mode": mode, "checked": True, "prompts": len(reference), "identical": len(reference) - len(diverged),
           **agreement(reference, outputs, encode)}
    if changed:
        out["note"] = f"numerics differ from the baseline ({', '.join(f'{k}={v}' for k, v in changed.items())}): " \
                      "outputs are compared but need not be identical"
    if diverged:
        out["first_divergence"] = {"prompt": diverged[0][0], **diverged[0][1]}
    return out
