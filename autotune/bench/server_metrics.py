"""The server's own view of a run: Prometheus /metrics scraped before and after, reduced to acceptance.

Embedded: autotune_spec_* counters. vLLM: vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total
(accept length = 1 + accepted/drafts). SGLang: sglang:spec_accept_length / spec_accept_rate gauges.
"""
import math
import re

import httpx

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+-?\d+)?\s*$")
# (verify steps, draft tokens, accepted tokens) counters; each verify step yields accepted + 1 tokens.
COUNTERS = {
    "embedded": ("autotune_spec_verify_steps_total", "autotune_spec_draft_tokens_total",
                 "autotune_spec_accepted_tokens_total"),
    "vllm": ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total"),
}
GAUGES = {"sglang": ("sglang:spec_accept_length", "sglang:spec_accept_rate")}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one engine may label by model or engine index)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        values[m.group(1)] = values.get(m.group(1), 0.0) + value
    return values


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """The server's /metrics, or None where it has none or cannot answer."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    return parse_prometheus(resp.text) if resp.status_code == 200 else None


def acceptance(before: dict | None, after: dict | None) -> dict:
    """Accept length and rate over the run, from counter deltas (or the gauges after it)."""
    none = {"server_accept_length": None, "server_accept_rate": None, "server_metrics_source": None}
    if not after:
        return none
    before = before or {}
    for source, (steps_name, drafted_name, accepted_name) in COUNTERS.items():
        if steps_name in after:
            steps, drafted, accepted = (after.get(n, 0.0) - before.get(n, 0.0)
                                        for n in (steps_name, drafted_name, accepted_name))
            if steps <= 0:
                return {**none, "server_metrics_source": source}
            return {"server_accept_length": 1 + accepted / steps,
                    "server_accept_rate": accepted / drafted if drafted > 0 else None,
                    "server_metrics_source": source}
    for source, (length_name, rate_name) in GAUGES.items():
        if length_name in after:
            finite = (lambda v: v if v is not None and math.isfinite(v) else None)
            return {"server_accept_length": finite(after.get(length_name)),
                    "server_accept_rate": finite(after.get(rate_name)), "server_metrics_source": source}
    return none
