"""The tuner against an engine's own defaults: for each workload x concurrency, `autotune run` a study,
then read its validation (the winner and the engine defaults, each relaunched fresh and benchmarked
`repeats` times in the same validation run) and print the validated gain with both sides' intervals.

    python3 benchmarks/bench_tuner.py --engine llamacpp --workloads code chat --concurrency 1 4 \
        --budget 5m --out benchmarks/results/cpu-2026-12-01/tuner-llamacpp

The study chooses its winner on its own trials; the gain reported here is validation's, measured on
fresh launches after the choice (choose on one run, report from another).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_study(args, workload: str, concurrency: int, studies: Path) -> dict:
    name = f"{args.engine}-{workload}-c{concurrency}"
    cmd = [sys.executable, "-m", "autotune.cli", "run", "--engine", args.engine, "--gpu", "auto", "--study", name,
           "--workload", workload, "--concurrency", str(concurrency), "--num-requests", str(args.num_requests),
           "--max-tokens", str(args.max_tokens), "--budget", args.budget, "--trials", str(args.trials)]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "AUTOTUNE_STUDIES_DIR": str(studies)},
                          capture_output=True, text=True, check=False)
    doc = {"workload": workload, "concurrency": concurrency, "command": " ".join(cmd), "exit": done.returncode,
           "wall_s": round(time.monotonic() - t0, 1)}
    validation = studies / name / "best" / "validation.json"
    if not validation.exists():
        doc["problem"] = (done.stderr.strip().splitlines() or ["no validation written"])[-1]
        return doc
    v = json.loads(validation.read_text())
    metric, winner, base = v["metric"], v.get("winner"), v["baseline"]
    doc["baseline"] = {"config": base.get("config"), **(base.get("stats") or {}).get(metric, {})}
    if winner:
        doc["winner"] = {"trial": winner["trial"], "config": winner["config"], **winner["stats"][metric],
                         "warning": winner.get("warning")}
        doc["gain"] = winner.get("gain_over_baseline")
    doc["demoted"] = v.get("demoted")
    return doc


def cell(stats: dict) -> str:
    return f"{stats['median']:.1f} ({stats['ci95'][0]:.1f}..{stats['ci95'][1]:.1f})" if stats.get("median") else "-"


def table(rows: list[dict]) -> str:
    lines = ["| workload | concurrency | defaults tok/s (95% CI) | winner tok/s (95% CI) | gain | winner's changes |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base, win = r.get("baseline") or {}, r.get("winner") or {}
        changed = {k: v for k, v in (win.get("config") or {}).items() if (base.get("config") or {}).get(k) != v}
        gain = f"{r['gain']:.2f}x" if r.get("gain") else "-"
        lines.append(f"| {r['workload']} | {r['concurrency']} | {cell(base)} | {cell(win)} | {gain} | "
                     f"{changed or r.get('problem', '')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="llamacpp")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--budget", default="5m")
    ap.add_argument("--trials", type=int, default=25)
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    rows = []
    for workload in args.workloads:
        for concurrency in args.concurrency:
            rows.append(run_study(args, workload, concurrency, args.out / "studies"))
            print(json.dumps({k: rows[-1].get(k) for k in ("workload", "concurrency", "gain", "exit")}), flush=True)
    doc = {"commit": commit, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "engine": args.engine,
           "machine": f"{os.cpu_count()} CPUs ({os.uname().machine})", "rows": rows}
    (args.out / "tuner.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "tuner.md").write_text(f"commit {commit}\n\n{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
