"""The server's own view of a run: Prometheus /metrics scraped before and after, reduced to acceptance.

Which samples carry acceptance is each engine's facts' `spec_counters` (verify steps, draft tokens,
accepted tokens; accept length = 1 + accepted / steps) or `spec_gauges` (accept length, accept rate);
a scrape is matched to the engine whose names it holds.
"""
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from autotune.engines import ENGINES, get_adapter


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one engine may label by model or engine index).
    Raises ValueError on text that is not the Prometheus text format."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """The server's /metrics, or None where it has none, cannot answer or answers something else."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout)
        return parse_prometheus(resp.text) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def acceptance(before: dict | None, after: dict | None) -> dict:
    """Accept length and rate over the run, from counter deltas (or the gauges after it), read with the
    names of the engine whose metrics `after` holds (counters are preferred to gauges)."""
    none = {"server_accept_length": None, "server_accept_rate": None, "server_metrics_source": None}
    if not after:
        return none
    before = before or {}
    adapters = [get_adapter(name) for name in ENGINES]
    for adapter in adapters:
        if adapter.facts.spec_counters and adapter.facts.spec_counters[0] in after:
            steps, drafted, accepted = (after.get(n, 0.0) - before.get(n, 0.0) for n in adapter.facts.spec_counters)
            if steps <= 0:
                return {**none, "server_metrics_source": adapter.name}
            return {"server_accept_length": 1 + accepted / steps,
                    "server_accept_rate": accepted / drafted if drafted > 0 else None,
                    "server_metrics_source": adapter.name}
    for adapter in adapters:
        if adapter.facts.spec_gauges and adapter.facts.spec_gauges[0] in after:
            length, rate = (after.get(n) for n in adapter.facts.spec_gauges)
            return {"server_accept_length": finite(length), "server_accept_rate": finite(rate),
                    "server_metrics_source": adapter.name}
    return none


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
