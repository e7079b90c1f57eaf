"""Prometheus exposition (text format 0.0.4, through prometheus_client) of the embedded engine's counters.

Metrics served on GET /metrics (all engine-wide, since start):
  autotune_requests_total                  counter  generation requests submitted to the engine
  autotune_prompt_tokens_total             counter  prompt tokens prefilled
  autotune_generation_tokens_total         counter  tokens generated
  autotune_requests_running                gauge    requests holding a decode slot now
  autotune_requests_waiting                gauge    requests queued for a slot now (queue depth)
  autotune_spec_verify_steps_total         counter  target forward passes that produced tokens
  autotune_spec_draft_tokens_total         counter  tokens proposed by the drafter
  autotune_spec_accepted_tokens_total      counter  proposed tokens the target accepted
  autotune_spec_rejections_total           counter  verify steps that ended at a rejected proposal
  autotune_spec_accept_length              gauge    mean tokens generated per verify step (1.0 = no gain)
  autotune_spec_accept_rate                gauge    accepted / proposed draft tokens
  autotune_spec_draft_seconds_total        counter  time spent drafting
  autotune_spec_verify_seconds_total       counter  time spent in target verify/decode passes
  autotune_startup_compile_seconds         gauge    seconds compiling and capturing CUDA graphs before /health
                                                    answered (what a relaunch's compile cache may save)
  autotune_spec_batch_steps_total{batch}   counter  decode steps of `batch` sequences (what a draft schedule reads)
  autotune_spec_batch_draft_tokens_total{batch} counter  tokens proposed in those steps
  autotune_http_requests_total{path,status} counter HTTP requests answered, refused ones included (499:
                                                    the client left before any response)
  autotune_request_timeouts_total          counter  requests cancelled at the server's --request-timeout

The engine keeps these totals itself, under its scheduler lock (Engine.stats()); a custom collector
reads them at each scrape rather than mirroring them into prometheus_client Counter objects, which
could only be incremented from inside the engine loop and would be a second copy to keep in step.
"""
import collections

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE  # noqa: F401 - the /metrics route's

# (Engine.stats() key, metric name, type, help)
METRICS = (
    ("requests_total", "autotune_requests_total", "counter", "Generation requests submitted to the engine."),
    ("prompt_tokens_total", "autotune_prompt_tokens_total", "counter", "Prompt tokens prefilled."),
    ("generation_tokens_total", "autotune_generation_tokens_total", "counter", "Tokens generated."),
    ("requests_running", "autotune_requests_running", "gauge", "Requests holding a decode slot."),
    ("requests_waiting", "autotune_requests_waiting", "gauge", "Requests queued for a slot (queue depth)."),
    ("verify_steps", "autotune_spec_verify_steps_total", "counter", "Target passes that produced tokens."),
    ("draft_tokens", "autotune_spec_draft_tokens_total", "counter", "Tokens proposed by the drafter."),
    ("accepted_tokens", "autotune_spec_accepted_tokens_total", "counter", "Proposed tokens the target accepted."),
    ("rejections", "autotune_spec_rejections_total", "counter", "Verify steps ended by a rejected proposal."),
    ("accept_length", "autotune_spec_accept_length", "gauge", "Mean tokens per verify step."),
    ("accept_rate", "autotune_spec_accept_rate", "gauge", "Accepted / proposed draft tokens."),
    ("draft_seconds_total", "autotune_spec_draft_seconds_total", "counter", "Seconds spent drafting."),
    ("verify_seconds_total", "autotune_spec_verify_seconds_total", "counter", "Seconds spent verifying."),
    ("warmup_seconds", "autotune_startup_compile_seconds", "gauge",
     "Seconds spent compiling and capturing CUDA graphs before the server answered."),
)
FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
# (Engine.stats() key of a {batch size: count} dict, counter name, help)
BATCH_METRICS = (
    ("steps_by_batch", "autotune_spec_batch_steps", "Decode steps, by the number of sequences in the step."),
    ("draft_tokens_by_batch", "autotune_spec_batch_draft_tokens", "Tokens proposed, by the step's batch size."),
)


class EngineCollector:
    """METRICS read from `stats()` (an Engine.stats) at each collection."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        for key, name, kind, help_text in METRICS:
            yield FAMILIES[kind](name, help_text, value=float(stats[key]))
        for key, name, help_text in BATCH_METRICS:
            family = CounterMetricFamily(name, help_text, labels=("batch",))
            for batch, count in sorted(stats[key].items()):
                family.add_metric((str(batch),), count)
            yield family


class HttpCounts:
    """What the HTTP server counts itself (the engine never sees a request the server refused); changed on
    the event loop only."""

    def __init__(self):
        self.by_status: collections.Counter[tuple[str, int]] = collections.Counter()  # (path, status) -> n
        self.timeouts = 0

    def collect(self):
        family = CounterMetricFamily("autotune_http_requests", "HTTP requests answered, by path and status.",
                                     labels=("path", "status"))
        for (path, status), n in sorted(self.by_status.items()):
            family.add_metric((path, str(status)), n)
        yield family
        yield CounterMetricFamily("autotune_request_timeouts", "Requests cancelled at --request-timeout.",
                                  value=self.timeouts)


def registry(stats, http: HttpCounts | None = None) -> CollectorRegistry:
    """One server's registry: its engine's metrics (and its HTTP counts), nothing registered by other code."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats))
    if http is not None:
        registry.register(http)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
