"""SLO expressions such as "p95_ttft_ms<500; p95_itl_ms<=40; accept_length>1.5; error_rate<0.01".

Parsed once into an SLO; `check(summary)` lists the violated terms. Shared by the bench command and
the tuner's constraints, so both read the same names as the benchmark summary.
"""
import math
import operator
import re
from dataclasses import dataclass

from .metric_registry import LATENCIES, SCALARS, STATS

# Summary keys are "<latency>_<stat>"; an SLO may also say "<stat>_<latency>" as the issue writes it.
KNOWN = tuple(f"{stat}_{lat}" for lat in LATENCIES for stat in STATS) + tuple(m.name for m in SCALARS)
OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
TERM = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Term:
    metric: str  # as written in KNOWN, e.g. p95_ttft_ms
    op: str
    bound: float

    @property
    def summary_key(self) -> str:
        stat, _, latency = self.metric.partition("_")
        return f"{latency}_{stat}" if stat in STATS and latency in LATENCIES else self.metric

    def holds(self, value) -> bool:
        return value is not None and not math.isnan(value) and OPS[self.op](value, self.bound)

    def __str__(self):
        return f"{self.metric}{self.op}{self.bound:g}"


@dataclass(frozen=True)
class SLO:
    terms: tuple[Term, ...]
    text: str = ""

    def check(self, summary: dict) -> list[str]:
        """One line per violated term; empty when the summary meets the SLO."""
        violations = []
        for term in self.terms:
            value = summary.get(term.summary_key)
            if value is None:
                violations.append(f"{term}: {term.metric} not measured")
            elif not term.holds(value):
                violations.append(f"{term}: measured {value:.4g}")
        return violations

    def request_terms(self) -> list[tuple[str, str, Term]]:
        """(per-request column, stat, term) for latency terms, which goodput applies to each request."""
        out = []
        for term in self.terms:
            stat, _, latency = term.metric.partition("_")
            if stat in STATS and latency in LATENCIES:
                out.append((latency, stat, term))
        return out

    def __str__(self):
        return "; ".join(map(str, self.terms))


def parse_slo(text: str) -> SLO:
    """Parse "metric op number; ..."; raises ValueError naming the bad part and the known metrics."""
    terms = []
    for part in re.split(r"[;\n]", text):
        if not part.strip():
            continue
        m = TERM.match(part)
        if not m:
            raise ValueError(f"bad SLO term {part.strip()!r}: expected <metric><op><number> with op one of "
                             f"< <= > >=; known metrics: {', '.join(KNOWN)}")
        metric, op, bound = m.group(1), m.group(2), float(m.group(3))
        metric = canonical(metric)
        if metric is None:
            raise ValueError(f"unknown SLO metric {m.group(1)!r} in {part.strip()!r}; "
                             f"known metrics: {', '.join(KNOWN)}")
        terms.append(Term(metric, op, bound))
    if not terms:
        raise ValueError(f"empty SLO expression {text!r}; known metrics: {', '.join(KNOWN)}")
    return SLO(tuple(terms), text)


def canonical(name: str) -> str | None:
    """p95_ttft_ms, or the summary's own ttft_ms_p95, both become p95_ttft_ms."""
    if name in KNOWN:
        return name
    for lat in LATENCIES:
        for stat in STATS:
            if name == f"{lat}_{stat}":
                return f"{stat}_{lat}"
    return None
