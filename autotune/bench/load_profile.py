"""A load that changes over a run: phases run back to back, each at its own concurrency (closed loop) or
request rate (Poisson arrivals), each lasting a time or a number of requests.

Spec (`--load-profile`): comma-separated phases LOAD:LENGTH. LOAD is a concurrency (`4`) or a rate in
requests per second (`2/s`); LENGTH a time (`20s`, `1.5m`) or a request count (`32req`). So
"1:20s,2:20s,4:20s" steps from 1 to 4 streams. `ramp:LO-HI:TIME` doubles the concurrency from LO up to HI
(HI last) and splits TIME evenly over the steps; the preset `ramp` is 1 -> 2 -> 4 -> 8 -> 16, 20 s each.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

PRESETS = {"ramp": "ramp:1-16:100s"}
LOAD = re.compile(r"(?P<concurrency>\d+)|(?P<rate>\d+(?:\.\d+)?)/s")
LENGTH = re.compile(r"(?P<time>\d+(?:\.\d+)?)(?P<unit>s|m)|(?P<requests>\d+)req")
RAMP = re.compile(r"ramp:(?P<low>\d+)-(?P<high>\d+):(?P<length>.+)")
# Per-level results are also stored flat under this prefix (phase_c4_output_tok_s): a study's trials can be
# sorted and read by them, as the schedule fit does.
KEY_PREFIX = "phase_"


@dataclass(frozen=True)
class Phase:
    concurrency: int | None = None  # closed loop: requests kept in flight; with a rate, none (no cap)
    rate: float | None = None  # open loop: Poisson arrivals per second
    duration_s: float | None = None  # stop sending after this long; in-flight requests then finish
    requests: int | None = None  # or after this many requests

    @property
    def label(self) -> str:
        """The load level, as flat keys name it: c4 (4 streams) or r2 (2 requests/s)."""
        return f"c{self.concurrency}" if self.rate is None else f"r{self.rate:g}"

    def __str__(self) -> str:
        load = str(self.concurrency) if self.rate is None else f"{self.rate:g}/s"
        return f"{load}:{self.duration_s:g}s" if self.duration_s is not None else f"{load}:{self.requests}req"

    def expected_s(self, request_s: float, at_concurrency: int) -> float:
        """Seconds this phase should take when one request takes `request_s` at `at_concurrency` streams
        (a request at more streams is taken to be proportionally slower): what a deadline is set from."""
        slower = max(1.0, (self.concurrency or at_concurrency) / at_concurrency) * request_s
        if self.duration_s is not None:
            return self.duration_s + slower
        if self.rate is not None:
            return self.requests / self.rate + slower
        return math.ceil(self.requests / self.concurrency) * slower


@dataclass(frozen=True)
class LoadProfile:
    phases: tuple[Phase, ...]

    def __str__(self) -> str:
        return ",".join(map(str, self.phases))

    def concurrencies(self) -> list[int]:
        """The closed-loop levels, ascending, each once: what a warm-up runs."""
        return sorted({p.concurrency for p in self.phases if p.rate is None})

    def expected_s(self, request_s: float, at_concurrency: int) -> float:
        return sum(p.expected_s(request_s, at_concurrency) for p in self.phases)


def parse_load_profile(spec: str) -> LoadProfile:
    """A LoadProfile from its spec (module docstring); ValueError (one line) naming the bad part."""
    text = PRESETS.get(spec.strip(), spec.strip())
    ramp = RAMP.fullmatch(text)
    if ramp:
        return LoadProfile(ramp_phases(spec, int(ramp["low"]), int(ramp["high"]), ramp["length"]))
    if not text:
        raise ValueError(f"load profile {spec!r}: expected phases like 1:20s,4:20s or a preset ({', '.join(PRESETS)})")
    return LoadProfile(tuple(parse_phase(spec, part.strip()) for part in text.split(",")))


def parse_phase(spec: str, part: str) -> Phase:
    where = f"load profile {spec!r}: phase {part!r}"
    load_text, _, length_text = part.partition(":")
    load, length = LOAD.fullmatch(load_text.strip()), LENGTH.fullmatch(length_text.strip())
    if not load:
        raise ValueError(f"{where}: the load must be a concurrency (4) or a rate (2/s) before the ':'")
    if not length:
        raise ValueError(f"{where}: the length must be a time (20s, 1.5m) or a request count (32req) after the ':'")
    concurrency = int(load["concurrency"]) if load["concurrency"] else None
    rate = float(load["rate"]) if load["rate"] else None
    duration = float(length["time"]) * (60 if length["unit"] == "m" else 1) if length["time"] else None
    requests = int(length["requests"]) if length["requests"] else None
    if concurrency == 0 or rate == 0 or duration == 0 or requests == 0:
        raise ValueError(f"{where}: the load and the length must be above 0")
    return Phase(concurrency, rate, duration, requests)


def ramp_phases(spec: str, low: int, high: int, length: str) -> tuple[Phase, ...]:
    total = LENGTH.fullmatch(length.strip())
    if not 1 <= low <= high:
        raise ValueError(f"load profile {spec!r}: a ramp goes up from a concurrency >= 1 (ramp:1-16:60s)")
    if not total or not total["time"] or float(total["time"]) == 0:
        raise ValueError(f"load profile {spec!r}: a ramp's length is a time above 0 (60s, 2m), split over its steps")
    levels = [low * 2 ** i for i in range(math.floor(math.log2(high / low)) + 1)]
    levels += [high] if levels[-1] != high else []
    seconds = float(total["time"]) * (60 if total["unit"] == "m" else 1) / len(levels)
    return tuple(Phase(concurrency=c, duration_s=seconds) for c in levels)
