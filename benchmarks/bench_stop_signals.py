"""Does a draft-stop signal that also reads the request's recent history predict acceptance better (issue 17)?

    python3 benchmarks/bench_stop_signals.py --out DIR COLLECTION_DIR COLLECTION_DIR

Two traced collection passes of the same drafter (estimator-data.parquet + estimator.json, as
bench_stop_ceiling.py takes); each is fitted on and the other scored, both ways. Pure replay, modelled.

Signals of a proposed token, all known at runtime before or while it is drafted: the draft's entropy and top-1,
its position, the request's temperature, and the request's history as the runtime sees it (only proposed tokens
are ever judged): the previous drafted step's accepted count, whether it accepted its first token, its accepted
share of tested tokens, whether it accepted all, and an exponential average over the tested tokens so far.
AUC per signal on tested tokens (stop.py's sense: up to and including a step's first rejection), on all positions
and on the first only; the logistic models are fitted on the fit pass, so their AUC on the other is held out.

Rules (each fitted by grid on the fit pass's steps at its largest k, K, under its measured costs), replayed
step by step in order on the scored pass's steps at K under its costs, the history being what the rule itself
observed (a step it does not draft observes nothing):
  entropy            stop before a token of entropy above t, cap c (one band: the estimator has per-band ones);
  entropy split on previous
                     its threshold depends on whether the previous drafted step accepted its first token;
  logistic           stop before a token of predicted acceptance below t: entropy, top-1, position, temperature;
  logistic+history   the same with the history signals;
  +gate              and, before drafting, skip the step when a history + temperature model of the first token's
                     acceptance is below g (no draft pass spent);
  estimator.json     the fit pass's estimator as fitted (per-band threshold, per-request cap: bench_stop_ceiling).
Ratios against the best fixed k = 0..K of the scored steps (stop.replay), with the perfect-signal rule and the
oracle beside them (bench_stop_ceiling's), 90 % bootstrap over requests, the best fixed k chosen again each time.
A scored request whose prompt the fit pass also ran is left out of the score. Beside it, within the fit pass:
leave one prompt out (the rules fitted again without it), and how good a signal has to be: an exact signal
plus Gaussian noise, its AUC and its best (threshold, cap) rule (modelled, in-sample). Writes DIR/signals.json and
DIR/README.md (text below the README's NOTES line is kept).
"""
import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's autotune, run from anywhere

from bench_stop_ceiling import exact_risk, interval, policy, pooled, write_results

from autotune.embedded.draft_policy import load_estimator
from autotune.estimator import stop

RESAMPLES = 2000
PRIOR = 0.5  # the history signals before a request's first drafted step: nothing observed yet
EMA_KEEP = 0.8  # the exponential average's weight on the past, per tested token (about the last five)
HISTORY = ["prev_accepted", "prev_first", "prev_rate", "prev_full", "ema"]
TOKEN = ["entropy", "top1", "position", "temperature"]
MODEL_HISTORY = HISTORY[1:]  # the count depends on the step's k: the models take the k-free forms
GATE = ["temperature", *MODEL_HISTORY]
THRESHOLD_QUANTILES = np.linspace(0.05, 0.95, 19)
GATE_QUANTILES = np.linspace(0.05, 0.5, 10)
L2 = 1e-2
NOISE_SD = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)  # on an exact 0/1 signal: AUC from 1 down to ~0.6


class History:
    """What a request's earlier verify steps told the runtime: the outcome of the tokens it proposed."""

    def __init__(self):
        self.prev_accepted, self.prev_first, self.prev_rate, self.prev_full, self.ema = 0.0, PRIOR, PRIOR, PRIOR, PRIOR

    def values(self) -> list[float]:
        return [self.prev_accepted, self.prev_first, self.prev_rate, self.prev_full, self.ema]

    def update(self, proposed: int, accepted: int):
        if not proposed:  # nothing judged: the average drifts back to the prior, so a gated request drafts again
            self.ema = EMA_KEEP * self.ema + (1 - EMA_KEEP) * PRIOR
            return
        tested = min(proposed, accepted + 1)
        self.prev_accepted, self.prev_first = float(accepted), float(accepted > 0)
        self.prev_rate, self.prev_full = accepted / tested, float(accepted >= proposed)
        for j in range(tested):
            self.ema = EMA_KEEP * self.ema + (1 - EMA_KEEP) * (j < accepted)


def requests(rows: pd.DataFrame) -> list[dict]:
    """The traced requests: temperature, prompt text, k and steps [(entropy, top1, accepted)] in order."""
    out = []
    for row in rows.itertuples():
        steps = [(np.asarray(e, float), np.asarray(p, float), min(int(a), len(e)))
                 for e, p, a in stop.trace_of(row.spec_draft_trace) if len(e)]
        if steps:
            out.append({"temperature": float(row.temperature), "text": row.text, "k": int(row.k), "steps": steps,
                        "row": row})
    return out


def token_frame(reqs: list[dict]) -> pd.DataFrame:
    """One row per proposed token, with the history as recorded (the pass's fixed k proposed every token)."""
    out = []
    for r, req in enumerate(reqs):
        history = History()
        for entropy, top1, accepted in req["steps"]:
            h = history.values()
            for j, (e, p) in enumerate(zip(entropy, top1)):
                out.append([r, e, p, j, req["temperature"], *h, j < accepted, j <= accepted])
            history.update(len(entropy), accepted)
    return pd.DataFrame(out, columns=["request", *TOKEN, *HISTORY, "accepted", "tested"])


def fit_logistic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Weights (intercept first) of a logistic regression, Newton's method with a small ridge."""
    x = np.column_stack([np.ones(len(x)), x])
    w = np.zeros(x.shape[1])
    for _ in range(100):
        p = 1 / (1 + np.exp(-x @ w))
        step = np.linalg.solve((x * (p * (1 - p))[:, None]).T @ x + L2 * np.eye(len(w)), x.T @ (y - p) - L2 * w)
        w += step
        if np.abs(step).max() < 1e-9:
            break
    return w


def logit(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return w[0] + x @ w[1:]


@dataclass
class Rule:
    """Stop before the first token whose score (higher: more likely accepted) is below the threshold for the
    previous drafted step's first-token outcome (rejected, accepted), at most cap tokens; skip drafting when the
    gate's score is below gate_at. token: logistic weights over TOKEN + MODEL_HISTORY, None: score = -entropy."""
    name: str
    cap: int
    thresholds: tuple[float, float] = (-math.inf, -math.inf)
    token: np.ndarray | None = None
    gate: np.ndarray | None = None
    gate_at: float = -math.inf

    def request(self, req: dict, costs: dict) -> tuple[float, float]:
        """Tokens and plain-step cost of the request's steps under this rule (stop.replay's step model)."""
        history, tokens, cost = History(), 0.0, 0.0
        for entropy, top1, accepted in req["steps"]:
            h = history.values()
            limit = min(self.cap, len(entropy))
            drafts = limit and (self.gate is None or logit(self.gate, np.array([req["temperature"], *h[1:]]))
                                >= self.gate_at)
            n, passes = 0, 0
            if drafts:
                score = self.score(entropy[:limit], top1[:limit], req["temperature"], h)
                below = np.flatnonzero(score < self.thresholds[int(h[1] >= PRIOR)])
                n = int(below[0]) if len(below) else limit
                passes = n + 1 if len(below) else limit
            tokens += min(n, accepted) + 1
            cost += passes * costs["draft"] + costs["verify"][n + 1]
            history.update(n, min(n, accepted))
        return tokens, cost

    def score(self, entropy, top1, temperature, h) -> np.ndarray:
        if self.token is None:
            return -entropy
        x = np.column_stack([entropy, top1, np.arange(len(entropy)), np.full(len(entropy), temperature),
                             np.tile(h[1:], (len(entropy), 1))])
        return logit(self.token, x)


def replayed(rule: Rule, reqs: list[dict], costs: dict) -> np.ndarray:
    return np.array([rule.request(req, costs) for req in reqs])  # [requests, (tokens, cost)]


def grid(base: Rule, reqs: list[dict], costs: dict, cuts: list[float], gates: list[float], split: bool) -> Rule:
    """The rule of base's scores of the highest pooled speed over caps 0..K, thresholds (one, or one per previous
    outcome when split) and gate cuts on the fit requests."""
    best, speed = None, -1.0
    pairs = [(a, b) for a in cuts for b in cuts] if split else [(a, a) for a in cuts]
    for cap in range(max(r["k"] for r in reqs) + 1):
        for thresholds in (pairs if cap else pairs[:1]):
            for gate_at in (gates if cap else gates[:1]):
                rule = Rule(base.name, cap, thresholds, base.token, base.gate, gate_at)
                got = pooled(replayed(rule, reqs, costs))
                if got > speed + 1e-9:
                    best, speed = rule, got
    return best


def cuts_of(values: np.ndarray, quantiles: np.ndarray) -> list[float]:
    return [-math.inf, *sorted({round(float(q), 4) for q in np.quantile(values, quantiles)})]


def load(folder: Path) -> dict:
    if not (folder / "estimator-data.parquet").exists() or not (folder / "estimator.json").exists():
        raise SystemExit(f"{folder}: needs estimator-data.parquet and estimator.json (a traced collection pass)")
    doc = json.loads((folder / "estimator.json").read_text())
    if "stop_rule" not in doc:
        raise SystemExit(f"{folder}: estimator.json has no stop_rule (not a traced collection pass)")
    measured = doc["width_costs"]
    reqs = requests(pd.read_parquet(folder / "estimator-data.parquet"))
    widest = max(r["k"] for r in reqs)
    return {"folder": folder, "requests": reqs, "widest": [r for r in reqs if r["k"] == widest], "k": widest,
            "costs": {"verify": {int(w): c for w, c in measured["verify"].items()}, "draft": measured["draft"]},
            "estimator": load_estimator(str(folder / "estimator.json"))}


def fit(train: dict) -> tuple[list[Rule], dict]:
    tokens = token_frame(train["requests"])
    tested = tokens[tokens["tested"]]
    first = tested[tested["position"] == 0]
    y, y_first = tested["accepted"].to_numpy(float), first["accepted"].to_numpy(float)
    plain = fit_logistic(tested[TOKEN].to_numpy(), y)
    full = fit_logistic(tested[TOKEN + MODEL_HISTORY].to_numpy(), y)
    gate = fit_logistic(first[GATE].to_numpy(), y_first)
    models = {"logistic": np.append(plain, np.zeros(len(MODEL_HISTORY))), "logistic+history": full, "gate": gate}
    reqs, costs = train["widest"], train["costs"]
    entropy_cuts = cuts_of(-tested["entropy"].to_numpy(), THRESHOLD_QUANTILES)

    def logit_cuts(w):
        return cuts_of(logit(w, tested[TOKEN + MODEL_HISTORY].to_numpy()), THRESHOLD_QUANTILES)

    gate_cuts = cuts_of(logit(gate, first[GATE].to_numpy()), GATE_QUANTILES)
    rules = [grid(Rule("entropy", 0), reqs, costs, entropy_cuts, [-math.inf], False),
             grid(Rule("entropy split on previous", 0), reqs, costs, entropy_cuts, [-math.inf], True),
             grid(Rule("logistic", 0, token=models["logistic"]), reqs, costs, logit_cuts(models["logistic"]),
                  [-math.inf], False),
             grid(Rule("logistic+history", 0, token=full), reqs, costs, logit_cuts(full), [-math.inf], False),
             grid(Rule("logistic+history+gate", 0, token=full, gate=gate), reqs, costs, logit_cuts(full), gate_cuts,
                  False)]
    return rules, models


def signal_auc(tokens: pd.DataFrame, models: dict) -> dict:
    """AUC of each signal (sign fixed beforehand: higher = more likely accepted) on all tested tokens and on the
    first position only."""
    tested = tokens[tokens["tested"]]
    scores = {"entropy": -tested["entropy"], "top1": tested["top1"], "position": -tested["position"],
              "temperature": -tested["temperature"], **{h: tested[h] for h in HISTORY},
              "logistic": logit(models["logistic"], tested[TOKEN + MODEL_HISTORY].to_numpy()),
              "logistic+history": logit(models["logistic+history"], tested[TOKEN + MODEL_HISTORY].to_numpy()),
              "gate (history + temperature)": logit(models["gate"], tested[GATE].to_numpy())}
    first = (tested["position"] == 0).to_numpy()
    label = tested["accepted"].to_numpy()

    def rounded(v):
        return None if v is None else round(v, 4)

    return {name: {"all": rounded(stop.auc(np.asarray(s), label)),
                   "first": rounded(stop.auc(np.asarray(s)[first], label[first]))} for name, s in scores.items()}


def streaks(tokens: pd.DataFrame) -> dict:
    """First-token acceptance overall and after the previous step's first token was accepted / rejected (the
    streaks a history signal would read), as recorded."""
    first = tokens[tokens["position"] == 0]
    previous = first.groupby("request")["accepted"].shift()
    after = first[previous.notna()].assign(previous=previous[previous.notna()].astype(bool))
    return {"first_accepted": round(float(first["accepted"].mean()), 4),
            **{f"after_{name}": {"rate": round(float(part["accepted"].mean()), 4), "steps": len(part)}
               for name, part in (("accepted", after[after["previous"]]), ("rejected", after[~after["previous"]]))}}


def score(rules: list[Rule], train: dict, test: dict) -> dict:
    """The rules fitted on train (and its estimator.json) on test's requests whose prompt train did not run."""
    seen = {r["text"] for r in train["requests"]}
    reqs = [r for r in test["widest"] if r["text"] not in seen]
    costs, cap, estimator = test["costs"], test["k"], train["estimator"]
    replays = {rule.name: replayed(rule, reqs, costs) for rule in rules}
    replays["estimator.json (fit pass)"] = np.array(
        [stop.replay(*exact_arrays(r, estimator.signal, cap), *policy(estimator, r["row"]), costs) for r in reqs])
    return {**against_fixed(replays, reqs, costs, cap), "left_out_seen_prompts": len(test["widest"]) - len(reqs)}


def cross_validated(p: dict) -> dict:
    """Leave one prompt out within a pass: each prompt's request at K under the rules fitted on the others."""
    held, replays = [], {}
    for text in dict.fromkeys(r["text"] for r in p["widest"]):
        rest = [r for r in p["requests"] if r["text"] != text]
        rules, _ = fit({**p, "requests": rest, "widest": [r for r in rest if r["k"] == p["k"]]})
        mine = [r for r in p["widest"] if r["text"] == text]
        held += mine
        for rule in rules:
            replays.setdefault(rule.name, []).extend(replayed(rule, mine, p["costs"]))
    return {**against_fixed({n: np.array(r) for n, r in replays.items()}, held, p["costs"], p["k"]),
            "left_out_seen_prompts": 0}


def against_fixed(replays: dict, reqs: list[dict], costs: dict, cap: int) -> dict:
    """Each replay [requests, (tokens, cost)], the perfect signal and the oracle over the best fixed k of reqs,
    90 % bootstrap over requests."""
    fixed = np.array([replayed(Rule("fixed", k), reqs, costs) for k in range(cap + 1)])
    perfect = np.array([[exact_request(r, k, costs) for r in reqs] for k in range(cap + 1)])

    def ratios(draw):
        best = pooled(fixed[:, draw]).max()
        steps = [s for i in draw for s in reqs[i]["steps"]]
        proposed = np.array([min(cap, len(e)) for e, _, _ in steps])
        accepted = np.array([a for _, _, a in steps])
        return {"perfect signal": pooled(perfect[:, draw]).max() / best,
                "oracle": np.divide(*stop.oracle_replay(proposed, accepted, cap, costs)) / best,
                **{name: pooled(r[draw]) / best for name, r in replays.items()}}

    point = ratios(np.arange(len(reqs)))
    draws = np.random.default_rng(0).integers(0, len(reqs), size=(RESAMPLES, len(reqs)))
    boot = pd.DataFrame([ratios(d) for d in draws])
    speeds = pooled(fixed)
    return {"requests": len(reqs), "steps": sum(len(r["steps"]) for r in reqs), "k": cap,
            "best_fixed": f"k={int(speeds.argmax())}", "best_fixed_speed": round(float(speeds.max()), 4),
            "ratios": {n: {"ratio": round(float(point[n]), 4), "ci90": interval(boot[n])} for n in point}}


def needed(p: dict) -> list[dict]:
    """How good a signal has to be (modelled, in-sample, pooled steps at K): an exact signal (1 from a step's first
    rejected token on, else 0) plus Gaussian noise of each sd; its AUC on tested tokens and its best (threshold,
    cap) policy over the best fixed k."""
    arrays = [exact_arrays(r, "entropy", p["k"]) for r in p["widest"]]
    proposed, accepted = np.concatenate([a[1] for a in arrays]), np.concatenate([a[2] for a in arrays])
    position = np.arange(p["k"])
    inside = position < proposed[:, None]
    tested, label = inside & (position <= accepted[:, None]), position < accepted[:, None]
    caps = list(range(p["k"] + 1))
    best_fixed = max(np.divide(*stop.replay(exact_risk(accepted, p["k"]), proposed, accepted, np.inf, k, p["costs"]))
                     for k in caps)
    out, noise = [], np.random.default_rng(0).normal(size=inside.shape)
    for sd in NOISE_SD:
        risk = np.where(inside, exact_risk(accepted, p["k"]) + sd * noise, np.inf)
        by_cap = {c: (risk, proposed, accepted) for c in caps}
        _, cap, speed = stop.best_policy(by_cap, p["costs"], stop.candidate_thresholds(risk), caps)
        out.append({"noise_sd": float(sd), "auc": round(stop.auc(-risk[tested], label[tested]), 4), "cap": cap,
                    "ratio": round(float(speed / best_fixed), 4)})
    return out


def exact_arrays(req: dict, signal: str, cap: int):
    """stop.replay's arrays of one request's steps: risks [S, cap] (inf past its proposals), proposed, accepted."""
    risk = np.full((len(req["steps"]), cap), np.inf)
    for i, (e, p, _) in enumerate(req["steps"]):
        risk[i, : min(cap, len(e))] = stop.risks(e, p, signal)[:cap]
    return (risk, np.array([min(cap, len(e)) for e, _, _ in req["steps"]]),
            np.array([min(a, cap) for _, _, a in req["steps"]]))


def exact_request(req: dict, k: int, costs: dict) -> tuple[float, float]:
    _, proposed, accepted = exact_arrays(req, "entropy", max(k, 1))
    return stop.replay(exact_risk(accepted, max(k, 1)), proposed, accepted, 0.5, k, costs)


def describe(rule: Rule) -> dict:
    return {"cap": rule.cap, "thresholds": [None if math.isinf(t) else t for t in rule.thresholds],
            "gate_at": None if math.isinf(rule.gate_at) else rule.gate_at}


def main():
    args = parse()
    passes = [load(Path(d)) for d in args.dirs]
    directions = []
    for train, test in ((passes[0], passes[1]), (passes[1], passes[0])):
        rules, models = fit(train)
        directions.append({
            "fit": str(train["folder"]), "scored_pass": str(test["folder"]),
            "models": {name: dict(zip(["intercept", *(GATE if name == "gate" else TOKEN + MODEL_HISTORY)],
                                      np.round(w, 4).tolist())) for name, w in models.items()},
            "rules": {rule.name: describe(rule) for rule in rules},
            "auc_fit": signal_auc(token_frame(train["requests"]), models),
            "streaks_fit": streaks(token_frame(train["requests"])),
            "auc_scored": signal_auc(token_frame([r for r in test["requests"]
                                                  if r["text"] not in {q["text"] for q in train["requests"]}]),
                                     models),
            "scored": score(rules, train, test), "fit_on_itself": score(rules, {**train, "requests": []}, train),
            "fit_cross_validated": cross_validated(train), "needed_fit": needed(train)})
    write_results(Path(args.out), "signals.json",
                  {"resamples": RESAMPLES, "ema_keep": EMA_KEEP, "prior": PRIOR, "directions": directions}, tables)


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for signals.json and README.md")
    parser.add_argument("dirs", nargs=2, metavar="COLLECTION_DIR",
                        help="two traced collection passes of one drafter (estimator-data.parquet + estimator.json)")
    return parser.parse_args()


def tables(doc: dict) -> str:
    def row(cells):
        return "| " + " | ".join(map(str, cells)) + " |"

    def show(r):
        return f"{r['ratio']:.3f} ({r['ci90'][0]:.3f}..{r['ci90'][1]:.3f})"

    lines = ["# History-aware draft-stop signals (issue 17), fitted on one collection pass and scored on the other",
             "", f"Commit {doc['commit']}. Command:", "", f"    {doc['command']}", ""]
    for d in doc["directions"]:
        s, own = d["scored"], d["fit_on_itself"]
        lines += [f"## Fit on {short(d['fit'])}, scored on {short(d['scored_pass'])}", "",
                  (f"Scored: {s['requests']} requests / {s['steps']} steps at K = {s['k']} "
                  f"({s['left_out_seen_prompts']} left out: prompt also in the fit pass); best fixed {s['best_fixed']} "
                  f"({s['best_fixed_speed']:.3f} x k=0). Modelled / best fixed k of the same steps, 90 % bootstrap "
                  f"over requests."), "",
                  row(["signal", "AUC fit (all)", "AUC fit (first token)", "AUC scored (all)",
                       "AUC scored (first token)"]), row(["---"] * 5)]
        for name, a in d["auc_fit"].items():
            b = d["auc_scored"][name]
            lines.append(row([name, a["all"], a["first"], b["all"], b["first"]]))
        k = d["streaks_fit"]
        lines += ["", (f"Streaks (fit pass, as recorded): the first token is accepted in {k['first_accepted']:.0%} of "
                  f"steps, {k['after_accepted']['rate']:.0%} after a step whose first was accepted "
                  f"({k['after_accepted']['steps']} steps), {k['after_rejected']['rate']:.0%} after one whose "
                  f"first was rejected ({k['after_rejected']['steps']})."),
                  "", row(["rule", "fitted (cap, thresholds after reject/accept, gate)", "in-sample / best fixed",
                           "fit pass, leave one prompt out / best fixed", "**scored / best fixed**"]),
                  row(["---"] * 5)]
        for name in s["ratios"]:
            rule = d["rules"].get(name)
            shown = "-" if rule is None else f"{rule['cap']}, {rule['thresholds']}, {rule['gate_at']}"
            cv = d["fit_cross_validated"]["ratios"].get(name)
            lines.append(row([name, shown, show(own["ratios"][name]), show(cv) if cv else "-",
                              f"**{show(s['ratios'][name])}**"]))
        lines += ["", ("How good a signal has to be (fit pass, modelled, in-sample): an exact signal plus Gaussian noise, "
                       "its AUC on tested tokens and the best (threshold, cap) rule over the best fixed k."), "",
                  row(["noise sd", "AUC", "cap", "ratio / best fixed"]), row(["---"] * 4)]
        lines += [row([n["noise_sd"], n["auc"], n["cap"], f"{n['ratio']:.3f}"]) for n in d["needed_fit"]]
        lines.append("")
    return "\n".join(lines)


def short(folder: str) -> str:
    return folder.partition("benchmarks/results/")[2] or folder


if __name__ == "__main__":
    main()
