"""The draft-length estimator against the best single fixed draft length, on the embedded engine.

    python3 benchmarks/bench_estimator.py [--out DIR] [--rows ROWS.parquet] [--collect-limit 36]
        [--ks 0,1,2,4,8] [--limit 48] [--repeats 1] [--max-tokens 48] [--fixed 1,2,4,8] [--no-reference]
        [--rotation 0] [--threads 1] [--drafter ngram]
    python3 benchmarks/bench_estimator.py --estimator E.json --combine EVAL_DIR [EVAL_DIR ...]
    python3 benchmarks/bench_estimator.py --drafter quantized_self,early_exit --summary S.json ...

With several drafters (comma-separated) each gets DIR/<drafter>/ and, with --summary, one row of
{"machine", "drafter", "best_fixed_k", "ratio", "ci_low", "ci_high", "greedy_identical"} in S.json (a row of
the same machine and drafter is replaced).

1. Fit: a collection pass (code, chat and repetitive prompts not in the held-out set, interleaved;
   temperatures 0..1 round robin; each prompt at every k of --ks, back to back) on a fresh server, or
   the rows of an earlier pass (--rows).
2. Evaluate on the held-out mixed workload (temperatures 0..1): one server loaded with the estimator;
   per request the estimator arm, each fixed k >= 1 and k = 0 (speculation off; --no-reference drops it)
   run back to back in rotating order; a repeat is a full pass. Every fixed arm, k = 0 included, competes
   for "best fixed". Prints pooled tok/s per arm, estimator / best fixed k with a bootstrap 90 % interval
   (the best fixed arm chosen again on each resample; beside it the interval with the pooled winner
   frozen, and how often each fixed arm won a resample), the median paired per-request ratio, the
   per-bucket table and whether the greedy (temperature 0) outputs are identical. Writes
   DIR/estimator.json, DIR/estimator-eval/eval.json. The collection traces every proposal, so for model
   drafters (and n-gram, from the target's signals) the fit includes the runtime stop rule (stop.py).
3. --combine: pool several such runs (e.g. the same estimator, another --rotation) into one comparison.
4. --no-eval: the fit only (a setting chosen on collection data, never on the held-out set); prints and writes
   DIR/selection.json: the fitted estimator / the best fixed k (k = 0 included) replayed on the collection's
   own steps at the largest k under the measured step costs (in-sample), the AUC and the draft pass cost.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from autotune import estimator as est
from autotune.estimator import stop
from autotune.estimator.evaluate import row_features


def ints(text: str) -> list[int]:
    return [int(k) for k in text.split(",")]


def main():
    args = parse()
    if args.combine:
        return show(combine(args.estimator, args.combine))
    for drafter in args.drafter.split(","):
        out = Path(args.out) / drafter if "," in args.drafter else Path(args.out)
        doc = run(args, drafter, out)
        if not args.evaluate:
            continue
        show(doc)
        if args.summary:
            add_row(Path(args.summary), summary_row(doc, args.machine or machine(), drafter))


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/estimator", help="where the estimator and results go")
    parser.add_argument("--rows", help="fit on this parquet of a collection pass instead of collecting")
    parser.add_argument("--estimator", help="evaluate this estimator.json as it is (no collection, no fit)")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--threads", type=int, default=1, help="engine CPU threads (0 = torch's default)")
    parser.add_argument("--collect-limit", type=int, default=36, help="prompts in the collection pass")
    parser.add_argument("--collect-workloads", default="code,chat,repetitive",
                        help="workloads (shipped names or JSONL paths) of the collection pass, minus the held-out set; "
                             "a distilled draft needs prompts it was not trained on")
    parser.add_argument("--ks", default="0,1,2,4,8", help="draft lengths of the collection pass")
    parser.add_argument("--limit", type=int, default=48, help="held-out requests evaluated")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--fixed", default="1,2,4,8", help="fixed draft lengths (>= 1) compared")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="run k = 0 (speculation off) as a fixed arm that competes for best fixed (default; "
                             "--no-reference leaves it out)")
    parser.add_argument("--rotation", type=int, default=0, help="which arm goes first on the first request")
    parser.add_argument("--combine", nargs="+", metavar="EVAL_DIR",
                        help="pool the eval-requests.parquet of these runs of --estimator (no new measurement)")
    parser.add_argument("--early-exit-layers", type=int, help="L of the early_exit drafter (default: the engine's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another engine setting for every server, e.g. --set step_shape=fixed (repeatable)")
    parser.add_argument("--no-eval", dest="evaluate", action="store_false",
                        help="collect and fit only; print the modelled ratio (selection.json), no held-out run")
    parser.add_argument("--summary", help="summary.json to put each drafter's row in")
    parser.add_argument("--machine", help="the summary rows' machine (default: the CUDA device's name, else 'cpu')")
    return parser.parse_args()


def run(args, drafter: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    engine = {"threads": args.threads} if args.threads else {}
    for setting in args.set:
        key, _, value = setting.partition("=")
        engine[key] = yaml.safe_load(value)
    if args.early_exit_layers and drafter == "early_exit":
        engine["early_exit_layers"] = args.early_exit_layers
    config = {"drafter": drafter, "draft_length": 4, **engine}
    if args.estimator:
        path = Path(args.estimator)
    else:
        if args.rows:
            rows = pd.read_parquet(args.rows)
        else:
            rows = est.collect(config, out, workloads=tuple(args.collect_workloads.split(",")), ks=tuple(ints(args.ks)),
                               limit=args.collect_limit, max_tokens=args.max_tokens)
            rows.to_parquet(out / "estimator-data.parquet", index=False)
        fitted = est.fit(rows, source=args.rows or "collection pass")
        fitted.info["engine_config"] = config
        path = fitted.write(out)
        print(f"fitted on {len(rows)} requests: feature {fitted.primary.feature}, c {fitted.c}, "
              f"k table {fitted.primary.k_table}, quality {json.dumps(fitted.info['feature_quality'])}")
        rule = fitted.info.get("stop_rule")
        if rule:
            print(f"stop rule: {rule['signal']} above {rule['thresholds']} per temperature band, caps {rule['caps']}, "
                  f"replayed speedup {rule['expected_speedup']}, AUC {rule['auc']} on {rule['tokens']} tokens; "
                  f"costs {json.dumps(fitted.info['width_costs'])}")
        if not args.evaluate:
            selection = modelled_ratio(path, rows)
            (out / "selection.json").write_text(json.dumps(selection, indent=1) + "\n")
            print("selection (collection data, in-sample):", json.dumps(selection))
            return selection
    return est.evaluate(path, out / "estimator-eval", fixed=ints(args.fixed), repeats=args.repeats,
                        max_tokens=args.max_tokens, limit=args.limit, engine=engine, reference=args.reference,
                        rotation=args.rotation)


def modelled_ratio(path: Path, rows: pd.DataFrame) -> dict:
    """The fitted estimator (per-request cap and stop threshold) against every fixed k, k = 0 included,
    replayed (stop.replay) on the traced steps of the collection's runs at its largest k, which every cap
    can replay, under the collection's measured step costs: tokens per plain-step time."""
    from autotune.embedded.draft_policy import load_estimator

    estimator, costs = load_estimator(str(path)), stop.width_costs(rows)
    widest = rows[rows["k"] == rows["k"].max()].reset_index(drop=True)
    risk, proposed, accepted, request = stop.step_arrays(widest, estimator.signal, int(widest["k"].max()))

    def speed(policy) -> float:  # policy(row) -> (threshold, cap)
        tokens = cost = 0.0
        for i, row in enumerate(widest.itertuples()):
            threshold, cap = policy(row)
            mine = request == i
            t, c = stop.replay(risk[mine], proposed[mine], accepted[mine], threshold, cap, costs)
            tokens, cost = tokens + t, cost + c
        return tokens / cost

    def fitted(row):
        features = row_features(row)
        cap = estimator(features)
        threshold = estimator.stop_above(features) if estimator.stop_above and cap else None
        return (np.inf if threshold is None else threshold), cap

    fixed = {f"k={k}": speed(lambda row, k=k: (np.inf, k)) for k in range(int(widest["k"].max()) + 1)}
    best = max(fixed, key=fixed.get)
    mine = speed(fitted)
    doc = json.loads(path.read_text())
    rule = doc.get("stop_rule", {})
    return {"modelled_ratio": round(mine / fixed[best], 4), "best_fixed": best,
            "modelled_speed": {"estimator": round(mine, 4), **{a: round(v, 4) for a, v in fixed.items()}},
            "steps": len(risk), "requests": len(widest), "draft_pass": costs["draft"], "verify": costs["verify"],
            "auc": rule.get("auc"), "signal": rule.get("signal"), "thresholds": rule.get("thresholds"),
            "replayed_speedup_per_band": rule.get("expected_speedup")}


def machine() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def summary_row(doc: dict, machine_name: str, drafter: str) -> dict:
    low, high = doc["gain_interval_90"]
    return {"machine": machine_name, "drafter": drafter, "best_fixed_k": int(doc["best_fixed"][2:]),
            "ratio": round(1 + doc["gain"], 4), "ci_low": round(1 + low, 4), "ci_high": round(1 + high, 4),
            "greedy_identical": not any(doc["greedy_outputs_differ_any_arm"].values())}


def add_row(path: Path, row: dict):
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if (r["machine"], r["drafter"]) != (row["machine"], row["drafter"])] + [row]
    path.write_text(json.dumps(rows, indent=1) + "\n")


def combine(estimator: str, dirs: list[str]) -> dict:
    """Several eval runs of one estimator as one: each run's repeats renumbered after the previous run's."""
    from autotune.embedded.draft_policy import load_estimator

    frames, offset = [], 0
    for d in dirs:
        frame = pd.read_parquet(Path(d) / "eval-requests.parquet")
        frames.append(frame.assign(repeat=frame["repeat"] + offset))
        offset += frame["repeat"].max() + 1
    doc = json.loads(Path(estimator).read_text())
    return {"runs": dirs, **est.summarize(pd.concat(frames, ignore_index=True), doc, load_estimator(estimator))}


def show(doc: dict):
    best = doc["best_fixed"]
    print("tok/s pooled:", json.dumps({a: round(v, 3) for a, v in doc["tok_s"].items()}))
    print("tok/s per repeat:", json.dumps({a: [round(v, 2) for v in vs] for a, vs in doc["tok_s_per_repeat"].items()}))
    print("estimator k used:", doc["estimator_k_counts"])
    print("modelled tokens per plain-step time (engine counters x fitted step costs):",
          json.dumps({a: v and round(v, 3) for a, v in doc["modelled_speed"].items()}))
    print(pd.DataFrame(doc["buckets"]).round(3).to_string(index=False))
    low, high = doc["gain_interval_90"]
    frozen_low, frozen_high = doc["gain_interval_90_frozen_arm"]
    print("best fixed arm per bootstrap resample:",
          json.dumps({a: round(v, 3) for a, v in doc["best_fixed_bootstrap_share"].items() if v}))
    print(f"estimator / best fixed ({best}): {1 + doc['gain']:.3f} (90 % bootstrap {1 + low:.3f}..{1 + high:.3f}, "
          f"best fixed re-chosen per resample; {1 + frozen_low:.3f}..{1 + frozen_high:.3f} with {best} frozen; "
          f"median paired per-request ratio {doc['paired_ratio_median']:.3f}); greedy outputs differ from {best} on "
          f"{len(doc['greedy_outputs_differ'])} of {doc['greedy_requests']}, from any arm on "
          f"{len({i for v in doc['greedy_outputs_differ_any_arm'].values() for i in v})}")


if __name__ == "__main__":
    main()
