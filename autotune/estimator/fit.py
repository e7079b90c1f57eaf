"""Fit the draft-length estimator: per feature bucket x temperature band, alpha and the best k.

Per request (feature_frame): prompt features and alpha (model.alpha_mle). Per cell of a feature's
buckets x temperature bands (fit_table): alpha pooled over its requests and
  k* = argmax_k (1 - alpha^(k+1)) / ((1 - alpha) cost(k)), k = 0 included (speedup exactly 1: no
       speculation for requests where no k pays), k up to the largest k measured (cost: see cost.py).
Cells with fewer than MIN_TRIALS Bernoulli trials borrow alpha from their bucket (all bands), then
from all data. Features: the engine's prompt_entropy and the model-free compression_ratio and
unigram_entropy; the one whose value ranks per-request alpha best (|Spearman|) is chosen, and the
best model-free one is fitted too as the fallback the standalone module uses.

With traced proposals (a collection pass with draft_trace: model drafters, or n-gram with the target's
signals), stop.py fits the runtime stop rule (threshold per temperature band) and replaces each table's
k with the cap of the highest replayed tokens per second under that rule.
"""
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from autotune.embedded.draft_policy import TEXT_FEATURES, table_k
from autotune.estimator.cost import draft_cost, step_costs
from autotune.estimator.engine_settings import engine_settings
from autotune.estimator.model import alpha_mle, best_k, expected_speedup, rejections_from_moments
from autotune.estimator.standalone import standalone_module
from autotune.estimator.stop import fit_stop, trace_of

ENGINE_FEATURE = "prompt_entropy"
CANDIDATES = (ENGINE_FEATURE, *TEXT_FEATURES)
TEMPERATURE_EDGES = (0.0, 0.5)  # bands: greedy, (0, 0.5], above 0.5
MIN_TRIALS = 30
N_BUCKETS = 3
COUNTS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


def feature_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """rows (text, temperature, top_p, usage counters) -> the same with per-request features and alpha."""
    missing = [c for c in ("text", "temperature", *COUNTS, "spec_accepted_tokens") if c not in rows]
    if missing:
        raise ValueError(f"the request data lacks {', '.join(missing)}")
    out = rows.copy()
    out["top_p"] = out["top_p"] if "top_p" in out else 1.0
    if ENGINE_FEATURE not in out:
        out[ENGINE_FEATURE] = np.nan
    for name, fn in TEXT_FEATURES.items():
        out[name] = [fn(t) for t in out["text"]]
    if "spec_rejections" not in out or out["spec_rejections"].isna().any():
        estimated = [rejections_from_moments(s, p, a) for s, p, a in
                     zip(out["spec_verify_steps"], out["spec_draft_tokens"], out["spec_accepted_tokens"])]
        known = out["spec_rejections"] if "spec_rejections" in out else pd.Series(np.nan, index=out.index)
        out["rejections_estimated"] = known.isna()
        out["spec_rejections"] = known.fillna(pd.Series(estimated, index=out.index))
    out["alpha"] = [alpha_mle(a, r) for a, r in zip(out["spec_accepted_tokens"], out["spec_rejections"])]
    return out


def feature_quality(frame: pd.DataFrame) -> dict:
    """|Spearman| of each candidate feature (and top_p) against per-request alpha, within temperature bands."""
    usable = frame[(frame["spec_accepted_tokens"] + frame["spec_rejections"]) >= 3]
    bands = np.searchsorted(TEMPERATURE_EDGES, usable["temperature"], side="left")
    quality = {}
    for name in (*CANDIDATES, "top_p"):
        rhos, weights = [], []
        for band in np.unique(bands):
            part = usable[bands == band][[name, "alpha"]].dropna()
            if len(part) >= 5 and part[name].nunique() > 1 and part["alpha"].nunique() > 1:
                rhos.append(part[name].corr(part["alpha"], method="spearman"))
                weights.append(len(part))
        rho = float(np.average(rhos, weights=weights)) if rhos else None
        quality[name] = {"spearman": None if rho is None else round(rho, 4), "requests": int(sum(weights))}
    return quality


@dataclass
class Table:
    """k per temperature band x feature bucket of one feature, and what it was fitted from."""

    feature: str
    thresholds: list[float]
    temperature_edges: list[float]
    k_table: list[list[int]]
    buckets: list[dict] = field(default_factory=list)  # one per cell: ranges, trials, alpha, k, expected speedup

    def k(self, value: float, temperature: float) -> int:
        return table_k(asdict(self), value, temperature)


def fit_table(frame: pd.DataFrame, feature: str, c: float, max_k: int, step_cost: dict | None = None) -> Table:
    values = frame[feature].astype(float)
    thresholds = sorted({round(float(q), 6) for q in values.quantile(np.arange(1, N_BUCKETS) / N_BUCKETS)})
    bucket = np.searchsorted(thresholds, values, side="right")
    band = np.searchsorted(TEMPERATURE_EDGES, frame["temperature"], side="left")
    acc, rej = frame["spec_accepted_tokens"].to_numpy(float), frame["spec_rejections"].to_numpy(float)

    def pooled(mask):
        return acc[mask].sum(), rej[mask].sum()

    edges = [-math.inf, *TEMPERATURE_EDGES, math.inf]
    cuts = [-math.inf, *thresholds, math.inf]
    k_table, cells = [], []
    for b in range(len(TEMPERATURE_EDGES) + 1):
        row = []
        for q in range(len(thresholds) + 1):
            for source, mask in (("cell", (band == b) & (bucket == q)), ("bucket", bucket == q), ("all", bucket >= 0)):
                a, r = pooled(mask)
                if a + r >= MIN_TRIALS or source == "all":
                    break
            alpha = alpha_mle(a, r)
            alpha = 0.0 if alpha is None else alpha
            k = best_k(alpha, c, max_k, step_cost)
            row.append(k)
            cells.append({"band": b, "temperature": finite([max(edges[b], 0.0), edges[b + 1]]), "bucket": q,
                          feature: finite([cuts[q], cuts[q + 1]]), "requests": int(((band == b) & (bucket == q)).sum()),
                          "accepted": int(a), "rejections": int(round(r)), "alpha": round(alpha, 4),
                          "alpha_from": source, "k": k, "expected_speedup": round(expected_speedup(alpha, k, c, step_cost), 4)})
        k_table.append(row)
    return Table(feature, thresholds, list(TEMPERATURE_EDGES), k_table, cells)


def finite(bounds: list[float]) -> list[float | None]:
    """JSON has no infinity: an open end of a range is null."""
    return [None if math.isinf(x) else x for x in bounds]

@dataclass
class Estimator:
    primary: Table
    fallback: Table  # model-free: what the standalone module computes from the prompt alone
    c: float
    info: dict  # c's provenance, feature quality, the fitted data

    def draft_length(self, prompt: str, temperature: float = 0.0, top_p: float = 1.0,
                     prompt_entropy: float | None = None) -> int:
        """The fitted k; uses the primary feature when it can be computed, else the fallback."""
        if self.primary.feature == ENGINE_FEATURE and prompt_entropy is not None:
            return self.primary.k(prompt_entropy, temperature)
        table = self.fallback if self.primary.feature == ENGINE_FEATURE else self.primary
        return table.k(TEXT_FEATURES[table.feature](prompt), temperature)

    def to_json(self) -> dict:
        p = asdict(self.primary)
        return {"format": "autotune-draft-estimator/1", **{k: p[k] for k in ("feature", "thresholds",
                "temperature_edges", "k_table")}, "buckets": p["buckets"], "c": self.c,
                "fallback": asdict(self.fallback), **self.info}

    def write(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "estimator.json").write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")
        (out / "draft_length_estimator.py").write_text(
            standalone_module(asdict(self.fallback), self.primary.feature, self.c, self.info.get("stop_rule")))
        return out / "estimator.json"


def fit(rows: pd.DataFrame, *, c: float | None = None, max_k: int | None = None, source: str = "") -> Estimator:
    """Fit the estimator on per-request rows (see feature_frame). Raises ValueError on unusable data."""
    if rows is None or len(rows) == 0:
        raise ValueError("no request data to fit on")
    frame = feature_frame(rows)
    frame = frame[frame["spec_verify_steps"] > 0]
    drafted = int((frame["spec_accepted_tokens"] + frame["spec_rejections"]).sum())
    if drafted < MIN_TRIALS:
        where = f"{len(frame)} requests with verify steps" if len(frame) else "no request drafted: was the drafter 'none'?"
        raise ValueError(f"too little speculation in the data to fit on: {drafted} draft-token outcomes, {MIN_TRIALS} "
                         f"needed ({where}); a longer study or --num-requests gives more")
    cost = {"c": c, "c_from": "given"} if c is not None else draft_cost(frame)
    step_cost = None if c is not None else step_costs(frame)
    if max_k is None:  # never extrapolate the cost model past what was measured
        max_k = int(frame["k"].max()) if "k" in frame and frame["k"].notna().any() else 8
    if step_cost:
        step_cost = {k: v for k, v in step_cost.items() if k <= max_k}
    quality = feature_quality(frame)
    rank = {n: abs(q["spearman"]) if q["spearman"] is not None else -1.0 for n, q in quality.items()}
    usable = [n for n in CANDIDATES if frame[n].notna().all()]
    primary = max(usable, key=lambda n: rank[n])
    fallback = max(TEXT_FEATURES, key=lambda n: rank[n])
    tables = {n: fit_table(frame, n, cost["c"], max_k, step_cost) for n in {primary, fallback}}
    stop = fit_stop_rule(frame, tables) if traced(frame) else {}
    data_cols = ["text", "temperature", "top_p", *CANDIDATES, *COUNTS, "spec_rejections", "alpha",
                 *[col for col in ("k", "spec_draft_seconds", "spec_verify_seconds") if col in frame]]
    info = {**{k: v for k, v in cost.items() if k != "c"}, "max_k": max_k,
            "step_cost": step_cost and {str(k): v for k, v in step_cost.items()},
            "speedup_model": "tokens per step (alpha) / measured step_cost[k]" if step_cost else
            "tokens per step (alpha) / (1 + k c)", "feature_quality": quality,
            "fallback_feature": fallback, "source": source, "requests": len(frame),
            "rejections_from": "estimated from accepts per step (the rows lack spec_rejections)"
            if frame.get("rejections_estimated", pd.Series([False])).any() else "counted by the engine",
            "data": json.loads(frame[data_cols].to_json(orient="records")), **stop}
    return Estimator(tables[primary], tables[fallback], cost["c"], info)


def traced(frame: pd.DataFrame) -> bool:
    return "spec_draft_trace" in frame and bool(frame["spec_draft_trace"].map(lambda t: len(trace_of(t)) > 0).any())


def fit_stop_rule(frame: pd.DataFrame, tables: dict[str, Table]) -> dict:
    """The stop rule (stop.py) on traced rows; each table's k becomes the fitted cap under it. Returns
    estimator.json's stop_rule, width_costs and engine_settings keys."""
    frame = frame.reset_index(drop=True)
    band = np.searchsorted(TEMPERATURE_EDGES, frame["temperature"], side="left")
    buckets = {n: np.searchsorted(t.thresholds, frame[n].astype(float), side="right") for n, t in tables.items()}
    rule, caps, costs = fit_stop(frame, band, buckets, list(TEMPERATURE_EDGES))
    for name, table in tables.items():
        for b, row in enumerate(caps[name]):
            table.k_table[b] = row + table.k_table[b][len(row):]  # a bucket no request fell in keeps its k
        for cell in table.buckets:
            cell["k"] = table.k_table[cell["band"]][cell["bucket"]]
            cell["k_from"] = "replayed steps under the stop rule"
    costs["verify"] = {str(w): c for w, c in costs["verify"].items()}
    return {"stop_rule": rule, "width_costs": costs, "engine_settings": engine_settings(rule, tables)}
