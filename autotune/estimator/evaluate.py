"""Evaluate an estimator: its throughput against the best single fixed k (k = 0, no speculation,
included), on one server, interleaved.

evaluate measures (one request at a time, every arm on each request back to back); summarize turns
per-request rows (one run's, or several pooled) into the comparison.
"""
import json
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pandas as pd

from autotune.embedded.draft_policy import TEXT_FEATURES, load_estimator
from autotune.estimator.live import (
    DEFAULT_CONFIG,
    announce,
    chat_renderer,
    progress,
    requests_of,
    send,
    serve,
)
from autotune.estimator.model import alpha_mle


def evaluate(estimator_path: str | Path, log_dir: Path, *, workload: str = "mixed", fixed: list[int] | None = None,
             repeats: int = 2, max_tokens: int = 32, limit: int | None = None, engine: dict | None = None,
             reference: bool = True, rotation: int = 0) -> dict:
    """Throughput (completion tokens / request seconds, one request at a time) of the estimator policy and of
    each fixed k on one server; per request the arms run back to back in rotating order, each repeat a full
    pass. k = 0 (speculation off) is one of the fixed arms and can be the best one (`reference=False` leaves it
    out unless 0 is in `fixed`). An arm's throughput pools all its requests and repeats; the best fixed k is the
    fixed arm with the highest. Beside that: the median of paired per-request ratios (estimator tok/s / best
    fixed tok/s on the same request and repeat, run back to back) and a bootstrap 90 % interval of the
    throughput ratio (requests resampled, the best fixed arm chosen again on each resample: see summarize).
    Greedy (temperature 0) outputs of every arm are compared with the estimator's.
    `engine` overrides the estimator file's engine settings (e.g. {"threads": 1}); `rotation` shifts which
    arm goes first on each request (a second run with another rotation changes every arm's neighbours)."""
    estimate = load_estimator(str(estimator_path))  # the engine's own reading of the file: one-line ValueError
    doc = json.loads(Path(estimator_path).read_text())
    config = dict(doc.get("engine_config") or DEFAULT_CONFIG, **(engine or {}), draft_policy="fixed")
    fixed = fixed or sorted({k for row in doc["k_table"] for k in row} | {config["draft_length"]})
    reference = reference or 0 in fixed
    fixed = sorted({k for k in fixed if k >= 1})
    if not fixed and not reference:
        raise ValueError("give at least one fixed draft length to compare with")
    todo = requests_of([workload], max_tokens=max_tokens)[:limit]
    arms = ["estimator", *(f"k={k}" for k in fixed), *(["k=0"] if reference else [])]
    runs = {arm: [] for arm in arms}
    bar, task = progress(len(todo) * len(arms) * repeats, "eval")
    log_dir.mkdir(parents=True, exist_ok=True)
    with bar:
        announce(bar, "eval", len(todo) * len(arms) * repeats)
        with serve(dict(config, draft_estimator=str(estimator_path)), log_dir) as server, \
                httpx.Client(timeout=300) as client:
            client.post(server.base_url + "/admin/runtime", json={"draft_policy": "estimator"}).raise_for_status()
            for rep in range(repeats):
                results = {arm: [] for arm in arms}
                for i, request in enumerate(todo):
                    turn = (i + rep + rotation) % len(arms)
                    for arm in arms[turn:] + arms[:turn]:
                        extra = {} if arm == "estimator" else {"draft_length": int(arm[2:])}
                        results[arm].append(send(client, server.base_url, request, **extra))
                        bar.advance(task)
                for arm in arms:
                    runs[arm].append(results[arm])

    render = chat_renderer(config.get("model"))
    texts = [render(r["messages"]) if r["api"] == "chat" else r["prompt"] for r in todo]
    frame = pd.DataFrame([dict(r, arm=arm, repeat=rep, request=i, temperature=todo[i]["temperature"],
                               top_p=todo[i].get("top_p", 1.0), text=texts[i])
                          for arm in arms for rep, results in enumerate(runs[arm]) for i, r in enumerate(results)])
    report = {"estimator": str(estimator_path), "workload": workload, "requests": len(todo), "repeats": repeats,
              "max_tokens": max_tokens, "rotation": rotation, "engine_config": config,
              **summarize(frame, doc, estimate)}
    (log_dir / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    frame.to_parquet(log_dir / "eval-requests.parquet", index=False)
    return report


def row_features(row) -> dict:
    """The features the engine gives the estimator for a request, from its recorded row (itertuples)."""
    return {"prompt_entropy": row.prompt_entropy or 0.0, "prompt_text": row.text, "prompt_tokens": row.prompt_tokens,
            "prompt_chars": len(row.text), "temperature": row.temperature, "top_p": getattr(row, "top_p", 1.0)}


def request_cells(frame: pd.DataFrame, doc: dict, estimate) -> dict[int, tuple[int, int, int]]:
    """request -> (temperature band, feature bucket, the estimator's k), from its estimator-arm row."""
    cells = {}
    for row in frame[frame["arm"] == "estimator"].drop_duplicates("request").itertuples():
        features = row_features(row)
        value = features[doc["feature"]] if doc["feature"] in features else TEXT_FEATURES[doc["feature"]](row.text)
        cells[row.request] = (int(np.searchsorted(doc["temperature_edges"], row.temperature, side="left")),
                              int(np.searchsorted(doc["thresholds"], value, side="right")), estimate(features))
    return cells


def summarize(frame: pd.DataFrame, doc: dict, estimate, resamples: int = 2000) -> dict:
    """The comparison from per-request rows (arm, repeat, request, temperature, text, usage, output, seconds),
    one run's or several runs' pooled (repeat then tells the runs apart).

    Every fixed arm competes, k = 0 (speculation off) included: the best fixed arm is the fastest of them
    pooled. The bootstrap (requests resampled, all their repeats with them) chooses the best fixed arm again
    on each resample, so the interval of estimator / best fixed carries the noise of that choice too
    (`gain_interval_90`); `gain_interval_90_frozen_arm` keeps the pooled winner fixed instead, and
    `best_fixed_bootstrap_share` says how often each fixed arm won a resample."""
    arms = list(dict.fromkeys(frame["arm"]))
    fixed = [arm for arm in arms if arm.startswith("k=")]
    if "estimator" not in arms or not fixed:
        raise ValueError("the eval rows need the estimator arm and at least one fixed k arm")
    cells = request_cells(frame, doc, estimate)
    frame = frame.assign(k=[cells[q][2] if arm == "estimator" else int(arm[2:]) for arm, q in zip(frame["arm"], frame["request"])])
    step_cost = {int(k): v for k, v in (doc.get("step_cost") or {}).items()}

    def tok_s(rows):
        return rows["completion_tokens"].sum() / rows["seconds"].sum()

    def modelled(rows):  # tokens per plain-step time under the fitted cost model: free of machine noise
        if step_cost:  # steps that proposed (about draft_tokens / k) cost step_cost[k], the rest a plain step
            proposing = rows["spec_draft_tokens"] / rows["k"].clip(lower=1)
            cost = rows["spec_verify_steps"] - proposing + proposing * rows["k"].map(lambda k: step_cost.get(k, np.nan))
        else:
            cost = rows["spec_verify_steps"] + doc["c"] * rows["spec_draft_tokens"]
        return None if cost.isna().any() else float(rows["completion_tokens"].sum() / cost.sum())  # k not measured

    by_arm = {arm: frame[frame["arm"] == arm] for arm in arms}
    speed = {arm: tok_s(rows) for arm, rows in by_arm.items()}
    best = max(fixed, key=speed.get)
    requests = sorted(cells)
    # per arm (estimator first, then the fixed arms) and request: tokens and seconds over all repeats
    sums = [by_arm[arm].groupby("request")[["completion_tokens", "seconds"]].sum().reindex(requests, fill_value=0)
            for arm in ["estimator", *fixed]]
    tokens = np.array([s["completion_tokens"].to_numpy(float) for s in sums])
    seconds = np.array([s["seconds"].to_numpy(float) for s in sums])
    draws = np.random.default_rng(0).integers(0, len(requests), size=(resamples, len(requests)))
    resampled = tokens[:, draws].sum(axis=2) / seconds[:, draws].sum(axis=2)  # (arm, resample) tok/s
    winners = resampled[1:].argmax(axis=0)
    reselected = np.sort(resampled[0] / resampled[1:].max(axis=0))
    frozen = np.sort(resampled[0] / resampled[1 + fixed.index(best)])

    def interval(boot):
        return [float(boot[int(0.05 * len(boot))] - 1), float(boot[int(0.95 * len(boot)) - 1] - 1)]

    pair = by_arm["estimator"].merge(by_arm[best], on=["repeat", "request"], suffixes=("", "_best"))
    paired = (pair["completion_tokens"] / pair["seconds"]) / (pair["completion_tokens_best"] / pair["seconds_best"])
    greedy = [q for q in requests if frame[(frame["request"] == q)]["temperature"].iloc[0] == 0]
    mine_out = by_arm["estimator"].set_index(["repeat", "request"])["output"]
    differ = {arm: sorted({int(q) for (rep, q), out in by_arm[arm].set_index(["repeat", "request"])["output"].items()
                           if q in greedy and out != mine_out[(rep, q)]}) for arm in arms if arm != "estimator"}
    rows = []
    for cell in sorted({v[:2] for v in cells.values()}):
        idx = [q for q, v in cells.items() if v[:2] == cell]
        part = {arm: rows_[rows_["request"].isin(idx)] for arm, rows_ in by_arm.items()}
        mine, theirs = part["estimator"], part[best]
        mine_modelled, theirs_modelled = modelled(mine), modelled(theirs)
        row = {"band": cell[0], "bucket": cell[1], "requests": len(idx), "k": cells[idx[0]][2],
               "alpha": alpha_mle(mine["spec_accepted_tokens"].sum(), mine["spec_rejections"].sum()),
               "estimator_tok_s": tok_s(mine), f"{best}_tok_s": tok_s(theirs)}
        if "k=0" in part:
            row["k=0_tok_s"] = tok_s(part["k=0"])
        rows.append({**row, "ratio": tok_s(mine) / tok_s(theirs),
                     "paired_median": float(paired[pair["request"].isin(idx)].median()),
                     "modelled_ratio": mine_modelled / theirs_modelled if mine_modelled and theirs_modelled else None,
                     "best_fixed_here": max(fixed, key=lambda arm: tok_s(part[arm]))})
    return {"arms": arms, "tok_s": speed, "best_fixed": best, "gain": speed["estimator"] / speed[best] - 1,
            "gain_interval_90": interval(reselected), "gain_interval_90_frozen_arm": interval(frozen),
            "best_fixed_bootstrap_share": {arm: float(np.mean(winners == i)) for i, arm in enumerate(fixed)},
            "paired_ratio_median": float(paired.median()),
            "tok_s_per_repeat": {arm: [tok_s(g) for _, g in rows_.groupby("repeat")] for arm, rows_ in by_arm.items()},
            "modelled_speed": {arm: modelled(rows_) for arm, rows_ in by_arm.items()},
            "estimator_k_counts": {str(k): n for k, n in sorted(Counter(v[2] for v in cells.values()).items())},
            "greedy_requests": len(greedy), "greedy_outputs_differ": differ[best],
            "greedy_outputs_differ_any_arm": differ, "buckets": rows}
