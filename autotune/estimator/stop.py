"""The stop rule's fit: from each proposed token's signals (draft entropy, top-1 probability, position,
temperature, accepted), the acceptance curve, how well the signal ranks acceptance (AUC), and the
threshold per temperature band and cap per prompt-feature bucket of the highest expected tokens per second.

Data: a collection pass's requests at fixed k with draft_trace (collect.py), the stop rule off. Per verify
step the trace holds the risks of its proposals and how many were accepted; a token after the first
rejection was never tested, so the curve and AUC use each step's tokens up to and including its first
rejection (the acceptance of a token given the ones before it were accepted: what a stop decides on).

Expected speed of a policy (threshold t, cap K), replayed on the recorded steps of runs with k >= K: a step
proposes n = its first position j < K whose risk is above t (that token is not proposed), else K; it emits
min(n, accepted) + 1 tokens and costs n + 1 draft passes (K when no stop) plus a verify pass n + 1 wide,
each in plain-step units measured per width (width_costs: verify cost is not linear in width on CPU).
The oracle (oracle_replay) knows each step's accepted run: the ceiling of any stop rule on the same steps.
"""
import itertools
import json
import math

import numpy as np
import pandas as pd

from autotune.embedded.generate import STOP_SIGNALS

MIN_STEPS = 20  # a bucket with fewer recorded steps takes its band's cap
CURVE_BINS = 10


def trace_of(value) -> list:
    """A request's spec_draft_trace: the usage's list, or the JSON text a parquet file keeps it as."""
    if isinstance(value, str):
        return json.loads(value)
    return list(value) if isinstance(value, (list, np.ndarray)) else []


def risks(entropy: list[float], top1: list[float], signal: str) -> np.ndarray:
    return np.asarray(entropy, float) if signal == "entropy" else 1 - np.asarray(top1, float)


def token_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per proposed token of every traced step: request, k, temperature, position, entropy,
    top1, accepted, tested (at or before the step's first rejection)."""
    out = []
    for i, row in enumerate(rows.itertuples()):
        for step in trace_of(row.spec_draft_trace):
            entropy, top1, accepted = step
            for j, (e, p) in enumerate(zip(entropy, top1)):
                out.append((i, row.k, row.temperature, j, e, p, j < accepted, j <= accepted))
    return pd.DataFrame(out, columns=["request", "k", "temperature", "position", "entropy", "top1", "accepted",
                                      "tested"])


def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """P(score of an accepted token > that of a rejected one), ties half (Mann-Whitney)."""
    label = np.asarray(label, bool)
    n_pos, n_neg = label.sum(), (~label).sum()
    if not n_pos or not n_neg:
        return None
    ranks = pd.Series(score).rank().to_numpy()
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def acceptance_curve(tokens: pd.DataFrame, signal: str) -> list[dict]:
    """Acceptance rate per risk bin (quantiles of the tested tokens' risk)."""
    tested = tokens[tokens["tested"]]
    risk = pd.Series(risks(tested["entropy"], tested["top1"], signal), index=tested.index)
    edges = np.unique(np.quantile(risk, np.linspace(0, 1, CURVE_BINS + 1)))
    out = []
    for lo, hi in itertools.pairwise(edges):
        inside = (risk >= lo) & ((risk < hi) if hi < edges[-1] else (risk <= hi))
        if inside.any():
            out.append({"risk": [round(float(lo), 4), round(float(hi), 4)], "tokens": int(inside.sum()),
                        "accept": round(float(tested["accepted"][inside].mean()), 4)})
    return out


def width_costs(rows: pd.DataFrame) -> dict:
    """Measured costs in plain-step units: verify[w] (a verify pass w tokens wide, w = k + 1, from the
    requests at fixed k; a width between two measured ones is interpolated between them) and draft (one
    draft pass). Raises ValueError without k = 0 rows."""
    timed = rows[rows["spec_verify_steps"] > 0]
    plain = timed[timed["k"] == 0]
    if plain.empty:
        raise ValueError("the collection pass has no k = 0 requests: the plain step's cost is unknown")
    base = (plain["spec_draft_seconds"] + plain["spec_verify_seconds"]).sum() / plain["spec_verify_steps"].sum()
    verify, draft = {1: 1.0}, []
    for k, part in timed[timed["k"] > 0].groupby("k"):
        verify[int(k) + 1] = round(float(part["spec_verify_seconds"].sum() / part["spec_verify_steps"].sum() / base), 4)
        if part["spec_draft_tokens"].sum():
            draft.append(part["spec_draft_seconds"].sum() / part["spec_draft_tokens"].sum() / base)
    measured = sorted(verify)
    # widths between two measured ones (a pass without k = w - 1 in the data): linear between those two
    between = {w: round(float(np.interp(w, measured, [verify[m] for m in measured])), 4)
               for w in range(1, measured[-1] + 1) if w not in verify}
    return {"verify": {**verify, **between}, "measured_widths": measured, "plain_step_seconds": round(float(base), 6),
            "draft": round(float(np.median(draft)) if draft else 0.0, 4)}


def step_arrays(rows: pd.DataFrame, signal: str, width: int):
    """The traced steps of rows: risks [S, width] (inf past a step's proposals), proposed [S], accepted [S],
    and each step's request row."""
    risk, proposed, accepted, request = [], [], [], []
    for i, trace in enumerate(rows["spec_draft_trace"]):
        for entropy, top1, a in trace_of(trace):
            r = np.full(width, np.inf)
            r[: min(width, len(entropy))] = risks(entropy, top1, signal)[:width]
            risk.append(r)
            proposed.append(min(width, len(entropy)))
            accepted.append(min(a, width))
            request.append(i)
    return np.array(risk).reshape(-1, width), np.array(proposed), np.array(accepted), np.array(request)


def replay(risk, proposed, accepted, threshold: float, cap: int, costs: dict) -> tuple[float, float]:
    """Tokens and plain-step cost of the recorded steps under (threshold, cap): see the module docstring."""
    if cap == 0:
        return float(len(risk)), float(len(risk))
    limit = np.minimum(cap, proposed)
    over = (risk[:, :cap] > threshold) & (np.arange(cap) < limit[:, None])
    stopped = over.any(1)
    n = np.where(stopped, over.argmax(1), limit)
    passes = np.where(stopped, n + 1, limit)
    verify = np.array([costs["verify"].get(int(w), np.nan) for w in n + 1])
    return float((np.minimum(n, accepted) + 1).sum()), float((passes * costs["draft"] + verify).sum())


def oracle_replay(proposed, accepted, cap: int, costs: dict, prefix_only: bool = False) -> tuple[float, float]:
    """Tokens and plain-step cost of the recorded steps under an oracle stop that knows each step's accepted
    run: a step proposes n <= min(cap, its proposals) tokens, emits min(n, accepted) + 1 and costs n draft
    passes (none spent on a token it will not propose) plus a verify n + 1 wide. prefix_only: n = the accepted
    run (the first iterate below). Otherwise n is chosen per step for the highest total tokens / cost by
    Dinkelbach's iteration (pick the n of most tokens - speed x cost, re-rate, until the speed stops rising):
    shorter than the run where drafting does not pay even when right, longer where a measured wider verify
    costs less. Every fixed k <= cap and every (threshold, cap) policy replayed on the same steps is one choice
    of n at no lower cost, so none is faster: the ceiling of any stop rule there."""
    n = np.arange(cap + 1)
    tokens = np.minimum(n, np.asarray(accepted)[:, None]) + 1.0
    cost = n * costs["draft"] + np.array([costs["verify"][int(w)] for w in n + 1])
    allowed = n <= np.minimum(cap, proposed)[:, None]
    speed, rows = 0.0, np.arange(len(tokens))
    while True:
        pick = np.where(allowed, tokens - speed * cost, -np.inf).argmax(1)
        got = float(tokens[rows, pick].sum()), float(cost[pick].sum())
        if prefix_only or not got[1] or got[0] / got[1] <= speed * (1 + 1e-12):
            return got
        speed = got[0] / got[1]


def candidate_thresholds(risk: np.ndarray) -> list[float]:
    finite = risk[np.isfinite(risk)]
    return [math.inf, *sorted({round(float(q), 4) for q in np.quantile(finite, np.linspace(0.05, 0.95, 19))})] \
        if len(finite) else [math.inf]


def steps(arrays, k_of: np.ndarray, mask: np.ndarray, cap: int):
    """The recorded steps under mask that a policy with this cap can replay: those of runs with k >= cap."""
    keep = mask & (k_of >= cap)
    return arrays[0][keep], arrays[1][keep], arrays[2][keep]


def best_policy(steps_by_cap: dict, costs: dict, thresholds: list[float], caps: list[int]) -> tuple[float, int, float]:
    """(threshold, cap, expected speedup over plain decode) of the highest speedup; cap 0 = no speculation."""
    best = (math.inf, 0, 1.0)
    for cap in caps:
        risk, proposed, accepted = steps_by_cap[cap]
        if not len(risk):
            continue
        for t in thresholds:
            tokens, cost = replay(risk, proposed, accepted, t, cap, costs)
            if cost > 0 and tokens / cost > best[2] + 1e-9:
                best = (t, cap, tokens / cost)
    return best


def fit_stop(rows: pd.DataFrame, band: np.ndarray, buckets: dict[str, np.ndarray], temperature_edges: list[float]):
    """The stop rule and the caps: rows are a traced collection pass (one per request, with k), band its
    requests' temperature band, buckets per feature name each request's bucket. Returns (stop_rule dict,
    {feature: cap table [band][bucket]}, cost dict)."""
    costs = width_costs(rows)
    caps = sorted(int(k) for k in rows["k"].unique() if int(k) + 1 in costs["verify"])
    width = max(caps)
    tokens = token_frame(rows)
    if tokens.empty or width == 0:
        raise ValueError("the collection pass has no traced proposals (draft_trace) to fit a stop rule on")
    tested = tokens[tokens["tested"]]
    quality = {s: auc(-risks(tested["entropy"], tested["top1"], s), tested["accepted"]) for s in STOP_SIGNALS}
    fits = {}
    for signal in STOP_SIGNALS:
        arrays = step_arrays(rows, signal, width)
        risk, request = arrays[0], arrays[3]
        k_of = rows["k"].to_numpy()[request] if len(request) else np.array([], int)

        thresholds, speedups, cap_of_band = [], [], []
        tables = {name: [] for name in buckets}
        for b in range(len(temperature_edges) + 1):
            in_band = band[request] == b if len(request) else np.array([], bool)
            t, cap, speedup = best_policy({c: steps(arrays, k_of, in_band, c) for c in caps}, costs,
                                          candidate_thresholds(risk[in_band]), caps)
            thresholds.append(None if math.isinf(t) else t)
            speedups.append(round(speedup, 4))
            cap_of_band.append(cap)
            for name, bucket in buckets.items():  # the cap per prompt-feature bucket, under the band's threshold
                row = []
                for q in range(int(bucket.max()) + 1):
                    in_cell = in_band & (bucket[request] == q)
                    if in_cell.sum() < MIN_STEPS:
                        row.append(cap)
                        continue
                    row.append(best_policy({c: steps(arrays, k_of, in_cell, c) for c in caps}, costs, [t], caps)[1])
                tables[name].append(row)
        fits[signal] = {"signal": signal, "temperature_edges": list(temperature_edges), "thresholds": thresholds,
                        "caps": cap_of_band, "expected_speedup": speedups, "tables": tables}
    # the embedded engine takes the signal of the higher expected speed (weighted by steps per band)
    chosen = max(STOP_SIGNALS, key=lambda s: (sum(fits[s]["expected_speedup"]), quality[s] or 0))
    rule = {k: v for k, v in fits[chosen].items() if k != "tables"}
    rule.update(auc={s: None if q is None else round(q, 4) for s, q in quality.items()},
                tokens=len(tested), curve={s: acceptance_curve(tokens, s) for s in STOP_SIGNALS},
                alternatives={s: {k: v for k, v in f.items() if k != "tables"} for s, f in fits.items() if s != chosen},
                speed_model="replayed steps: tokens / (draft passes x draft + verify[width]), plain-step units")
    return rule, fits[chosen]["tables"], costs
