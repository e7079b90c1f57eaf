"""The draft-length estimator against the best single fixed draft length, on the embedded engine.

    python3 benchmarks/bench_estimator.py [--out DIR] [--rows ROWS.parquet] [--limit 24] [--repeats 2]
                                          [--max-tokens 32] [--fixed 2,4,6] [--drafter ngram]

1. Fit: a collection pass (code, chat and repetitive prompts not in the held-out set; k 1..8 round robin,
   temperatures 0..1) on a fresh server, or the rows of an earlier pass (--rows).
2. Evaluate on the held-out mixed workload (temperatures 0..1): one server loaded with the estimator;
   per request the estimator arm and each fixed k run back to back in rotating order; a repeat is a full
   pass. Prints tok/s medians, the ratio estimator / best fixed k, the per-bucket table and whether the
   greedy (temperature 0) outputs are identical. Writes DIR/estimator.json, DIR/estimator-eval/eval.json.
"""
import argparse
import json
from pathlib import Path

import pandas as pd

from autotune import estimator as est


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/estimator", help="where the estimator and results go")
    parser.add_argument("--rows", help="fit on this parquet of a collection pass instead of collecting")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--limit", type=int, default=24, help="held-out requests evaluated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--fixed", default="2,4,6", help="fixed draft lengths compared")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"drafter": args.drafter, "draft_length": 4}
    if args.rows:
        rows = pd.read_parquet(args.rows)
    else:
        rows = est.collect(config, out)
        rows.to_parquet(out / "estimator-data.parquet", index=False)
    fitted = est.fit(rows, source=args.rows or "collection pass")
    fitted.info["engine_config"] = config
    path = fitted.write(out)
    print(f"fitted on {len(rows)} requests: feature {fitted.primary.feature}, c {fitted.c}, "
          f"k table {fitted.primary.k_table}, quality {json.dumps(fitted.info['feature_quality'])}")
    doc = est.evaluate(path, out / "estimator-eval", fixed=[int(k) for k in args.fixed.split(",")],
                       repeats=args.repeats, max_tokens=args.max_tokens, limit=args.limit)
    best = doc["best_fixed"]
    print("tok/s per repeat:", json.dumps({a: [round(v, 2) for v in vs] for a, vs in doc["tok_s_per_repeat"].items()}))
    print(pd.DataFrame(doc["buckets"]).round(3).to_string(index=False))
    print(f"estimator / best fixed ({best}): {doc['tok_s_median']['estimator'] / doc['tok_s_median'][best]:.3f} "
          f"(medians {doc['tok_s_median']['estimator']:.2f} vs {doc['tok_s_median'][best]:.2f} tok/s); "
          f"greedy outputs differ on {len(doc['greedy_outputs_differ'])} of {doc['greedy_requests']}")


if __name__ == "__main__":
    main()
