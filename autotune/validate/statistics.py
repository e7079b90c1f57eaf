"""Beyond the noise: a metric's spread over repeats, and whether one configuration's runs beat another's.

Per metric: median, MAD and a bootstrap 95% interval of the median. A gain is the ratio of geometric
means with a Welch t interval on log values (scipy's Student t), Bonferroni-split over the looks.
"""
from __future__ import annotations

import numpy as np
from scipy import stats

from autotune.bench.metric_registry import MAXIMIZE


def spread(values: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """Median, MAD, MAD relative to the median, and a bootstrap 95% interval of the median."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return {"median": None, "mad": None, "rel_mad": None, "ci95": None, "values": []}
    median = float(np.median(v))
    mad = float(np.median(np.abs(v - median)))
    boot = np.median(np.random.default_rng(seed).choice(v, size=(resamples, v.size)), axis=1)
    return {"median": median, "mad": mad, "rel_mad": mad / abs(median) if median else 0.0,
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))], "values": v.tolist()}


def gain_interval(a: list[float], b: list[float], direction: str, confidence: float, looks: int = 1) -> dict | None:
    """How much better the runs `a` are than `b` (> 1: better): the ratio of their geometric means, with a
    Welch t interval of the difference of mean logs at `confidence`, Bonferroni-split over `looks` (each
    time repeats are added and the interval is read again is one more chance of a false win). None while
    either side has fewer than 2 values."""
    la = np.log([v for v in a if v is not None and v > 0])
    lb = np.log([v for v in b if v is not None and v > 0])
    if la.size < 2 or lb.size < 2:
        return None
    sign = 1.0 if direction == MAXIMIZE else -1.0
    diff = sign * float(la.mean() - lb.mean())
    va, vb = la.var(ddof=1) / la.size, lb.var(ddof=1) / lb.size
    half = 0.0
    if va + vb > 0:
        df = (va + vb) ** 2 / (va ** 2 / (la.size - 1) + vb ** 2 / (lb.size - 1))
        half = float(stats.t.ppf(1 - (1 - confidence) / looks / 2, df)) * float(np.sqrt(va + vb))
    return {"gain": float(np.exp(diff)), "interval": [float(np.exp(diff - half)), float(np.exp(diff + half))],
            "confidence": confidence, "looks": looks, "repeats": [int(la.size), int(lb.size)]}


def compare(a: dict, b: dict, metric: str, direction: str, confidence: float, looks: int) -> dict:
    """Record `a` against record `b`: gain interval and whether it clears 1.0."""
    g = gain_interval([r.get(metric) for r in a["runs"]], [r.get(metric) for r in b["runs"]], direction, confidence, looks)
    return {"a": a, "b": b, "winner": a["label"], "rival": b["label"], "rival_trial": b.get("trial"),
            **(g or {"gain": None, "interval": None, "repeats": [len(a["runs"]), len(b["runs"])]}),
            "beyond_noise": bool(g) and g["interval"][0] > 1.0}


def beats(a: dict, b: dict, metric: str, direction: str, confidence: float, looks: int) -> bool:
    return compare(a, b, metric, direction, confidence, looks)["beyond_noise"]
