"""The metric registry: each benchmark summary metric a rule or a person reads, with its label, unit, better
direction and shown precision. Objectives, validation, export, the report, ci and the SLO parser take their
names and directions from here, so a metric is spelled once (the summary itself: bench/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass

MAXIMIZE, MINIMIZE = "maximize", "minimize"


@dataclass(frozen=True)
class Metric:
    name: str  # the key in the benchmark summary, e.g. ttft_ms_p95
    label: str  # for people: column heads, axis titles, the launch script's comments
    unit: str  # "" for counts and ratios
    direction: str  # MAXIMIZE or MINIMIZE: which way is better
    digits: int = 1  # decimals shown

    def format(self, value) -> str:
        return "-" if value is None else f"{value:.{self.digits}f}"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == MAXIMIZE else a < b


# Per-request timings (and per-request decode speed), held in the summary at each of STATS: ttft_ms_p95.
LATENCIES = {"ttft_ms": ("TTFT", "ms", MINIMIZE, 0), "itl_ms": ("ITL", "ms", MINIMIZE, 1),
             "tpot_ms": ("TPOT", "ms", MINIMIZE, 1), "e2e_ms": ("e2e", "ms", MINIMIZE, 0),
             "decode_tok_s": ("decode", "tok/s", MAXIMIZE, 1)}
STATS = ("p50", "p90", "p95", "p99", "mean")
SCALARS = (Metric("output_tok_s", "output tok/s", "tok/s", MAXIMIZE, 1),
           Metric("request_throughput", "requests/s", "req/s", MAXIMIZE, 2),
           Metric("goodput", "goodput req/s", "req/s", MAXIMIZE, 2),
           Metric("error_rate", "error rate", "", MINIMIZE, 3),
           Metric("accept_length", "accept length", "tokens/step", MAXIMIZE, 2),
           Metric("accept_rate", "accept rate", "", MAXIMIZE, 2),
           Metric("peak_gpu_mem_gb", "peak GPU memory GB", "GB", MINIMIZE, 1),
           Metric("peak_rss_gb", "peak RSS GB", "GB", MINIMIZE, 1),
           Metric("failed", "failed requests", "", MINIMIZE, 0),
           Metric("completed", "completed requests", "", MAXIMIZE, 0))
METRICS = {m.name: m for m in SCALARS} | {
    f"{base}_{stat}": Metric(f"{base}_{stat}", f"{stat} {short} {unit}", unit, direction, digits)
    for base, (short, unit, direction, digits) in LATENCIES.items() for stat in STATS}

# Each trial stores these flat (Optuna's tools sort scalar attributes only) and validation keeps their spread.
HEADLINE = ("output_tok_s", "e2e_ms_p95", "ttft_ms_p95", "itl_ms_p95", "tpot_ms_p50", "decode_tok_s_p50",
            "accept_length", "error_rate")
# What the launch script's comments and ci's re-check show of each run.
SHOWN = ("output_tok_s", "e2e_ms_p95", "ttft_ms_p95", "itl_ms_p95", "accept_length")
# Kept per load level of a varying load (phase_c4_output_tok_s): what the schedule fit reads off a trial.
PER_LEVEL = ("output_tok_s", "ttft_ms_p50", "itl_ms_p50", "tpot_ms_p50", "accept_length", "completed")


def metric(name: str) -> Metric:
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r} (known: {', '.join(METRICS)})") from None
