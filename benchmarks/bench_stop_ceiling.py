"""The ceiling of any runtime draft-stop rule (issue 17), replayed on collection passes already recorded.

    python3 benchmarks/bench_stop_ceiling.py --out DIR [COLLECTION_DIR ...]

A COLLECTION_DIR holds a traced collection pass (estimator-data.parquet) and the estimator.json fitted on it,
whose width_costs are the pass's measured step costs (default: every such folder under
benchmarks/results/estimator-*/). Everything here is modelled, not measured: the traced verify steps of the
pass's runs at its largest k (K, which every cap can replay) replayed under those costs, tokens per plain-step
time (stop.py's model), in-sample. Per pass, against the best fixed k (k = 0..K, k = 0 included):
  fitted   the estimator as fitted (its per-request cap and per-band stop threshold; stop.replay);
  perfect  a stop rule whose signal is exact (it stops at the first rejected token, paying the pass that drafted
           it), under the best single cap;
  oracle   stop.oracle_replay: no wasted pass, the step's length chosen knowing its accepted run; no stop rule
           beats it on the same steps. "prefix" is its accepted-prefix form (n = the accepted run).
Each with a 90 % bootstrap interval over requests (resampled; the best fixed k, the perfect rule's cap and the
oracle's choices made again on each resample). Beside them, the measured estimator / best fixed of every eval
(eval.json under benchmarks/results/estimator-*/) that ran the same estimator.json.
Sweeps (modelled): the largest draft pass cost (plain steps) at which the oracle / best fixed still reaches
GOAL on the recorded acceptance, and, for a drafter that accepts each token with one probability alpha
(accepted runs geometric, cut at K) under the measured costs, the alpha at which it does.
Writes DIR/ceiling.json and DIR/README.md (text below the README's NOTES line is kept).
"""
import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's autotune, run from anywhere

from autotune import provenance
from autotune.embedded.draft_policy import load_estimator
from autotune.estimator import stop
from autotune.estimator.evaluate import row_features

GOAL = 1.08  # issue 17, point 4: +8 % over the best fixed k
RESAMPLES = 2000
DRAFT_COSTS = np.round(np.arange(0, 1.001, 0.01), 2)  # draft pass cost sweep, plain steps
ALPHAS = np.round(np.arange(0, 1.001, 0.01), 2)
IID_STEPS = 10_000  # steps a geometric acceptance law is written out as (counts rounded)
RESULTS = Path("benchmarks/results")
NOTES = "## What this says"


def main():
    args = parse()
    recorded = RESULTS.glob("estimator-*/**/estimator-data.parquet")
    dirs = [Path(d) for d in args.dirs] or sorted(p.parent for p in recorded if traced(p.parent))
    docs = [ceiling(d) for d in dirs]
    write_results(Path(args.out), "ceiling.json", {"goal": GOAL, "resamples": RESAMPLES, "passes": docs}, tables)


def write_results(out: Path, name: str, doc: dict, tables) -> None:
    """out/name (doc with the commit and the command) and out/README.md (tables(doc)), keeping the README's
    hand-written part below NOTES."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"commit": provenance.commit(), "command": "python3 " + shlex.join(sys.argv), **doc}
    (out / name).write_text(json.dumps(doc, indent=1) + "\n")
    readme = out / "README.md"
    notes = readme.read_text().partition(NOTES)[2] if readme.exists() else ""
    readme.write_text(tables(doc) + (f"\n{NOTES}{notes}" if notes else ""))
    print(tables(doc))


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ceiling.json and README.md")
    parser.add_argument("dirs", nargs="*", metavar="COLLECTION_DIR",
                        help="folders with estimator-data.parquet + estimator.json (default: all recorded)")
    return parser.parse_args()


def traced(folder: Path) -> bool:
    doc = folder / "estimator.json"
    return doc.exists() and "stop_rule" in json.loads(doc.read_text())


def ceiling(folder: Path) -> dict:
    if not (folder / "estimator-data.parquet").exists() or not traced(folder):
        raise SystemExit(f"{folder}: needs estimator-data.parquet and an estimator.json with a stop_rule "
                         "(a traced collection pass)")
    doc = json.loads((folder / "estimator.json").read_text())
    measured_costs = doc["width_costs"]
    costs = {"verify": {int(w): c for w, c in measured_costs["verify"].items()}, "draft": measured_costs["draft"]}
    estimator = load_estimator(str(folder / "estimator.json"))
    rows = pd.read_parquet(folder / "estimator-data.parquet")
    cap = int(rows["k"].max())
    widest = rows[rows["k"] == cap].reset_index(drop=True)
    risk, proposed, accepted, request = stop.step_arrays(widest, estimator.signal, cap)
    steps_of = [np.flatnonzero(request == i) for i in range(len(widest))]

    def per_request(risk_of, threshold, k):  # [requests, 2]: tokens and cost of each request's steps
        return np.array([stop.replay(risk_of[s], proposed[s], accepted[s], threshold, k, costs) for s in steps_of])

    fixed = np.array([per_request(risk, np.inf, k) for k in range(cap + 1)])  # [K + 1, requests, 2]
    perfect = np.array([per_request(exact_risk(accepted, cap), 0.5, k) for k in range(cap + 1)])
    fitted = np.array([stop.replay(risk[s], proposed[s], accepted[s], *policy(estimator, row), costs)
                       for s, row in zip(steps_of, widest.itertuples())])

    def ratios(draw):  # the modelled ratios of the requests in draw (with repeats) against its best fixed k
        s = np.concatenate([steps_of[i] for i in draw])
        best = pooled(fixed[:, draw]).max()
        return {"fitted": pooled(fitted[draw]) / best, "perfect": pooled(perfect[:, draw]).max() / best,
                "oracle": np.divide(*stop.oracle_replay(proposed[s], accepted[s], cap, costs)) / best,
                "prefix": np.divide(*stop.oracle_replay(proposed[s], accepted[s], cap, costs, True)) / best}

    point = ratios(np.arange(len(widest)))
    draws = np.random.default_rng(0).integers(0, len(widest), size=(RESAMPLES, len(widest)))
    boot = pd.DataFrame([ratios(d) for d in draws])
    speeds = pooled(fixed)
    tested = np.minimum(accepted + 1, proposed).sum()  # a step's tokens up to and including its first rejection
    config = doc.get("engine_config") or {}
    return {"folder": str(folder), "drafter": config.get("drafter"),
            "early_exit_layers": config.get("early_exit_layers") if config.get("drafter") == "early_exit" else None,
            "draft_model": Path(config["draft_model"]).name if config.get("draft_model") else None,
            "requests": len(widest), "steps": len(proposed), "k": cap, "draft_pass": costs["draft"],
            "verify": {w: costs["verify"][w] for w in range(1, cap + 2)},
            "accept_rate": round(float(accepted.sum() / tested), 4),
            "steps_with_accept": round(float((accepted > 0).mean()), 4),
            "fixed_speed": {f"k={k}": round(float(v), 4) for k, v in enumerate(speeds)},
            "best_fixed": f"k={int(speeds.argmax())}",
            **{name: {"ratio": round(float(point[name]), 4), "ci90": interval(boot[name])} for name in point},
            "sweep": sweep(proposed, accepted, cap, costs), "measured": measured(folder)}


def pooled(replayed: np.ndarray) -> np.ndarray:
    """Tokens per plain-step time of [..., requests, (tokens, cost)], requests pooled."""
    return replayed[..., 0].sum(-1) / replayed[..., 1].sum(-1)


def exact_risk(accepted: np.ndarray, cap: int) -> np.ndarray:
    """A signal that is exactly right: 1 from each step's first rejected token on, else 0."""
    return (np.arange(cap) >= accepted[:, None]).astype(float)


def policy(estimator, row) -> tuple[float, int]:
    """(threshold, cap) the fitted estimator gives this request (as bench_estimator.py's modelled ratio)."""
    features = row_features(row)
    cap = estimator(features)
    threshold = estimator.stop_above(features) if estimator.stop_above and cap else None
    return (np.inf if threshold is None else threshold), cap


def interval(boot: pd.Series) -> list[float]:
    ordered = np.sort(boot.to_numpy())  # the same quantiles as evaluate.summarize
    return [round(float(ordered[int(0.05 * len(ordered))]), 4),
            round(float(ordered[int(0.95 * len(ordered)) - 1]), 4)]


def over_best_fixed(proposed, accepted, cap: int, costs: dict) -> np.ndarray:
    """[oracle, perfect signal] / best fixed k, on steps pooled (the sweeps' model)."""
    exact = exact_risk(accepted, cap)
    speed = [[np.divide(*stop.replay(exact, proposed, accepted, threshold, k, costs)) for k in range(cap + 1)]
             for threshold in (np.inf, 0.5)]  # fixed k, perfect signal under cap k
    best, perfect = max(speed[0]), max(speed[1])
    return np.array([np.divide(*stop.oracle_replay(proposed, accepted, cap, costs)), perfect]) / best


def sweep(proposed, accepted, cap: int, costs: dict) -> dict:
    """Modelled: oracle and perfect signal / best fixed as the draft pass cost changes (recorded acceptance), and
    under a geometric acceptance law of each alpha (measured costs); where each reaches GOAL."""
    by_cost = np.array([over_best_fixed(proposed, accepted, cap, {**costs, "draft": d}) for d in DRAFT_COSTS])
    by_alpha = []
    for alpha in ALPHAS:
        law = np.append(alpha ** np.arange(cap) * (1 - alpha), alpha ** cap)  # P(accepted run = 0..cap)
        runs = np.repeat(np.arange(cap + 1), np.round(law * IID_STEPS).astype(int))
        by_alpha.append(over_best_fixed(np.full(len(runs), cap), runs, cap, costs))
    by_alpha = np.array(by_alpha)
    out = {}
    for i, bound in enumerate(("oracle", "perfect")):
        reach_cost = DRAFT_COSTS[by_cost[:, i] >= GOAL]
        reach_alpha = ALPHAS[by_alpha[:, i] >= GOAL]
        out[bound] = {"max_draft_pass_for_goal": float(reach_cost.max()) if len(reach_cost) else None,
                      "at_draft_pass_0": round(float(by_cost[0, i]), 4),
                      "alpha_range_for_goal": [float(reach_alpha.min()), float(reach_alpha.max())]
                      if len(reach_alpha) else None,
                      "iid_max": round(float(by_alpha[:, i].max()), 4),
                      "iid_max_at_alpha": float(ALPHAS[by_alpha[:, i].argmax()]),
                      "by_draft_pass": dict(zip(DRAFT_COSTS.tolist(), by_cost[:, i].round(4).tolist())),
                      "by_alpha": dict(zip(ALPHAS.tolist(), by_alpha[:, i].round(4).tolist()))}
    return out


def measured(folder: Path) -> list[dict]:
    """Every recorded eval of this estimator.json: estimator / best fixed, measured on held-out requests."""
    mine = str(folder / "estimator.json").partition(str(RESULTS) + "/")[2]
    out = []
    for path in sorted(RESULTS.glob("estimator-*/**/eval.json")):
        doc = json.loads(path.read_text())
        if mine and str(doc.get("estimator", "")).endswith(mine):
            low, high = doc["gain_interval_90"]
            out.append({"eval": str(path.parent), "best_fixed": doc["best_fixed"], "requests": doc["requests"],
                        "ratio": round(1 + doc["gain"], 4), "ci90": [round(1 + low, 4), round(1 + high, 4)]})
    return out


def name(p: dict) -> str:
    if p["early_exit_layers"]:
        return f"{p['drafter']} L={p['early_exit_layers']}"
    return f"{p['drafter']} ({p['draft_model']})" if p["draft_model"] else p["drafter"]


CEILING_HEADER = ["pass", "drafter", "requests / steps at K", "draft pass", "accepted (tested tokens)",
                  "best fixed (modelled, x k=0)", "fitted / best fixed", "perfect signal / best fixed",
                  "**oracle / best fixed**", "oracle, accepted prefix", "measured estimator / best fixed (eval)"]
SWEEP_HEADER = ["pass", "drafter", "draft pass measured", "bound", "max draft pass for the goal", "at draft pass 0",
                "alpha range for the goal (iid)", "iid best (at alpha)"]


def tables(doc: dict) -> str:
    def row(cells):
        return "| " + " | ".join(map(str, cells)) + " |"

    def show(r):
        return f"{r['ratio']:.3f} ({r['ci90'][0]:.3f}..{r['ci90'][1]:.3f})"

    lines = ["# The ceiling of any runtime draft-stop rule (issue 17), from recorded collection passes", "",
             f"Commit {doc['commit']}. Command:", "", f"    {doc['command']}", "",
             ("All ratios but the last column are **modelled** (replayed tokens per plain-step time under the "
              "pass's measured step costs, in-sample, on the traced steps of its runs at k = K) against the best "
              f"fixed k = 0..K of the same steps; 90 % bootstrap over requests ({doc['resamples']} resamples). "
              "The last column is measured: the held-out eval of the same estimator.json (estimator / best fixed, "
              "wall clock), its best fixed arm and request count."), "",
             row(CEILING_HEADER), row(["---"] * len(CEILING_HEADER))]
    for p in doc["passes"]:
        evals = "; ".join(f"{show(m)}, {m['best_fixed']}, {m['requests']} req." for m in p["measured"]) or "-"
        lines.append(row([folder_name(p), name(p), f"{p['requests']} / {p['steps']} (K = {p['k']})",
                          p["draft_pass"], f"{p['accept_rate']:.0%}",
                          f"{p['best_fixed']} ({max(p['fixed_speed'].values()):.3f})", show(p["fitted"]),
                          show(p["perfect"]), f"**{show(p['oracle'])}**", f"{p['prefix']['ratio']:.3f}", evals]))
    lines += ["", ("Sweeps (modelled, the same cost model), for the oracle and the perfect-signal rule: the largest "
                   "draft pass cost (plain steps, grid 0.01) at which the ratio to the best fixed k reaches "
                   f"{doc['goal']} on the pass's recorded acceptance (and the ratio at a free draft pass); and, with "
                   "the pass's measured costs, a drafter accepting each token with one probability alpha (runs "
                   "geometric, cut at K): the alpha range (grid 0.01) where the ratio reaches it, and its best ratio "
                   "over alpha."), "", row(SWEEP_HEADER), row(["---"] * len(SWEEP_HEADER))]
    for p in doc["passes"]:
        for bound, s in p["sweep"].items():
            reach, cost = s["alpha_range_for_goal"], s["max_draft_pass_for_goal"]
            lines.append(row([folder_name(p), name(p), p["draft_pass"], bound,
                              "none, even at 0" if cost is None else cost, f"{s['at_draft_pass_0']:.3f}",
                              f"{reach[0]:.2f}..{reach[1]:.2f}" if reach else "none",
                              f"{s['iid_max']:.3f} ({s['iid_max_at_alpha']:.2f})"]))
    return "\n".join(lines) + "\n"


def folder_name(p: dict) -> str:
    return p["folder"].partition(str(RESULTS) + "/")[2] or p["folder"]


if __name__ == "__main__":
    main()
