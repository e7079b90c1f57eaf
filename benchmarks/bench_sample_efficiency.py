"""Sample efficiency of the tuner on a real, recorded grid of the embedded engine.

    python3 benchmarks/bench_sample_efficiency.py --measure   # once: every grid cell, live (slow)
    python3 benchmarks/bench_sample_efficiency.py             # replay: tuner vs random vs one-at-a-time

Measure: every cell of GRID below is benchmarked against a real `autotune serve` (one launch per
launch-time combination, draft_length changed live), on the `code` workload, and appended to
benchmarks/data/grid_embedded_code.csv (re-running resumes where it stopped). threads=2 is what
torch picks by itself on the 2-core machine the table was recorded on (the engine default, None).

Replay: each strategy proposes configurations; the recorded output tok/s is its measurement. Count
the distinct cells measured until one reaches 97% of the grid's best; median over 20 seeds.
- tuner: the study's own sampler (autotune.study.objectives.make_sampler: TPE as configured), seeds
  from search_spaces/embedded.yaml first, duplicates free (the driver reuses recorded results);
  also shown without the seeds (TPE alone), to separate what the seeds give from what TPE finds;
- random: cells in a random order, without repeats;
- one-at-a-time (SGLang auto_benchmark's strategy): from the engine defaults, sweep one parameter
  over its values with the others fixed, keep the best, go to the next parameter; the parameter
  order is shuffled per seed.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import optuna

from autotune import PROJECT_ROOT
from autotune.space import load_space

CSV = PROJECT_ROOT / "benchmarks" / "data" / "grid_embedded_code.csv"
GRID = {"drafter": ["none", "ngram", "early_exit"], "draft_length": [2, 4, 8], "dtype": ["float32", "bfloat16"],
        "threads": [1, 2], "verify_slots": [4]}  # 28 cells: what a busy 2-core machine measures in ~30 min
LAUNCH = ("drafter", "dtype", "threads", "verify_slots")  # one server per combination; draft_length is live
DEFAULTS = {"drafter": "none", "draft_length": None, "dtype": "float32", "threads": 2, "verify_slots": 4}
FIXED = {"draft_policy": "fixed", "ngram_min": 1, "ngram_max": 4, "early_exit_layers": 8, "prefill_ubatch": 256,
         "quantization": "none", "compile": "none", "cuda_graph_batch_sizes": []}
LOAD = dict(workload="code", concurrency=4, num_requests=4, max_tokens=32, warmup=1)
LOAD_TEXT = "(" + ", ".join(LAUNCH) + ")"
SEEDS, TARGET = 20, 0.97


def cells() -> list[dict]:
    """Every grid cell, grouped by launch configuration (the order they are measured in)."""
    out = []
    for launch in itertools.product(*(GRID[name] for name in LAUNCH)):
        cell = dict(zip(LAUNCH, launch))
        for k in (GRID["draft_length"] if cell["drafter"] != "none" else [None]):
            out.append({**cell, "draft_length": k})
    return out


def key(cell: dict) -> tuple:
    return tuple(cell.get(k) if cell.get("drafter") != "none" or k != "draft_length" else None for k in GRID)


# -- measuring ---------------------------------------------------------------------------------------
def measure():
    from autotune.bench import load_workload, run_benchmark
    from autotune.engines import get_adapter
    from autotune.engines.launcher import LaunchError, Launcher, free_port

    adapter, workload = get_adapter("embedded"), load_workload(LOAD["workload"])
    done = {key(_typed(r)) for r in _read()} if CSV.exists() else set()
    CSV.parent.mkdir(parents=True, exist_ok=True)
    new_file = not CSV.exists()
    todo = [c for c in cells() if key(c) not in done]
    print(f"{len(todo)} of {len(cells())} cells to measure", flush=True)
    with CSV.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*GRID, "output_tok_s", "e2e_ms_p95", "accept_length", "launch_s",
                                               "bench_s", "error"])
        if new_file:
            f.write(f"# `python3 benchmarks/bench_sample_efficiency.py --measure`, started "
                    f"{time.strftime('%Y-%m-%d %H:%M %Z')} on a shared 2-core CPU machine (other work running): "
                    f"embedded engine, bundled SmolLM2-135M, workload {LOAD['workload']}, concurrency "
                    f"{LOAD['concurrency']}, {LOAD['num_requests']} requests x {LOAD['max_tokens']} tokens after "
                    f"{LOAD['warmup']} warm-up, one launch per {LOAD_TEXT}, other settings {FIXED}\n")
            writer.writeheader()
        for launch, group in itertools.groupby(todo, key=lambda c: tuple(c[name] for name in LAUNCH)):
            group = list(group)
            config = {**FIXED, **dict(zip(LAUNCH, launch)),
                      **({"draft_length": group[0]["draft_length"]} if launch[0] != "none" else {})}
            port = free_port()
            argv, env = adapter.command(config, model=None, draft_model=None, host="127.0.0.1", port=port)
            server = Launcher(argv, env=env, log_path=Path("/tmp") / f"grid-{'-'.join(map(str, launch))}.log",
                              health_url=f"http://127.0.0.1:{port}/health", base_url=f"http://127.0.0.1:{port}")
            t0 = time.monotonic()
            try:
                server.start(timeout=300)
            except LaunchError as e:
                for cell in group:
                    writer.writerow({**cell, "error": e.kind})
                continue
            launch_s = time.monotonic() - t0
            try:
                for cell in group:
                    if cell["draft_length"] is not None:
                        adapter.apply_runtime(server.base_url, {"draft_length": cell["draft_length"]})
                    t0 = time.monotonic()
                    r = run_benchmark(server.base_url, workload, concurrency=LOAD["concurrency"], warmup=LOAD["warmup"],
                                      num_requests=LOAD["num_requests"], max_tokens=LOAD["max_tokens"], progress=False)
                    s = r.summary
                    row = {**cell, "output_tok_s": round(s["output_tok_s"], 3), "e2e_ms_p95": round(s["e2e_ms_p95"], 1),
                           "accept_length": round(s.get("accept_length") or 0, 3), "launch_s": round(launch_s, 1),
                           "bench_s": round(time.monotonic() - t0, 1), "error": s.get("failed") or ""}
                    writer.writerow(row)
                    f.flush()
                    print(row, flush=True)
            finally:
                server.stop()


def _read() -> list[dict]:
    with CSV.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _typed(row: dict) -> dict:
    return {"drafter": row["drafter"], "draft_length": int(row["draft_length"]) if row["draft_length"] else None,
            "dtype": row["dtype"], "threads": int(row["threads"]), "verify_slots": int(row["verify_slots"]),
            "value": float(row["output_tok_s"]) if row.get("output_tok_s") else 0.0}


# -- replaying ---------------------------------------------------------------------------------------
def grid_space():
    """search_spaces/embedded.yaml narrowed to the grid, everything else pinned as measured."""
    space = load_space("embedded").narrowed({k: v for k, v in GRID.items()})
    params = dict(space.params)
    for name, value in FIXED.items():
        params[name] = replace(params[name], fixed=value)
    params["threads"] = replace(params["threads"], default=DEFAULTS["threads"])  # torch's own choice here
    return replace(space, params=params)


def run_tuner(table: dict, goal: float, seed: int, budget: int, seeded: bool = True) -> int:
    from autotune.study.objectives import make_sampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = grid_space()
    study = optuna.create_study(direction="maximize", sampler=make_sampler("throughput", seed=seed))
    for config in space.seed_configs() if seeded else []:
        study.enqueue_trial(space.trial_params(config), user_attrs={"seed_config": config})
    seen: dict[tuple, float] = {}
    for _ in range(budget * 20):
        trial = study.ask()
        k = key(space.suggest(trial))
        if k not in seen:
            seen[k] = table[k]
            if seen[k] >= goal:
                return len(seen)
            if len(seen) >= budget:
                break
        study.tell(trial, seen[k])
    return budget


def run_random(table: dict, goal: float, seed: int) -> int:
    order = list(table)
    random.Random(seed).shuffle(order)
    return next(i + 1 for i, k in enumerate(order) if table[k] >= goal)


def run_one_at_a_time(table: dict, goal: float, seed: int) -> int:
    names = list(GRID)
    random.Random(seed).shuffle(names)
    current = {**DEFAULTS, "draft_length": 4}  # draft_length counts once a drafter is on
    seen: dict[tuple, float] = {}

    def measure_cell(cell):
        k = key(cell)
        seen.setdefault(k, table[k])
        return seen[k]

    best = measure_cell(current)
    if best >= goal:
        return 1
    for _ in range(2):  # a second pass, as a patient user would do
        for name in names:
            for value in GRID[name]:
                candidate = {**current, name: value}
                v = measure_cell(candidate)
                if v >= goal:
                    return len(seen)
                if v > best:
                    best, current = v, candidate
    return len(table)  # never reached it: counts as having to measure everything


def replay():
    grid = {key(c) for c in cells()}
    table = {key(r): r["value"] for r in map(_typed, _read()) if key(r) in grid}  # rows of an earlier, wider grid left out
    missing = [c for c in cells() if key(c) not in table]
    if missing:
        sys.exit(f"grid incomplete: {len(missing)} cells missing; run with --measure")
    best_key = max(table, key=table.get)
    goal = TARGET * table[best_key]
    n = len(table)
    results = {
        "tuner (TPE)": [run_tuner(table, goal, s, n) for s in range(SEEDS)],
        "TPE, no seeds": [run_tuner(table, goal, s, n, seeded=False) for s in range(SEEDS)],
        "random": [run_random(table, goal, s) for s in range(SEEDS)],
        "one-at-a-time": [run_one_at_a_time(table, goal, s) for s in range(SEEDS)],
    }
    default = table[key(DEFAULTS)]
    print(f"grid: {n} cells, best {table[best_key]:.2f} tok/s at {dict(zip(GRID, best_key))}; "
          f"97% = {goal:.2f}; engine defaults {default:.2f} tok/s")
    print(f"{'strategy':<16}{'median trials':>14}{'% of grid':>10}  (over {SEEDS} seeds; min..max)")
    medians = {}
    for name, counts in results.items():
        medians[name] = statistics.median(counts)
        print(f"{name:<16}{medians[name]:>14.1f}{100 * medians[name] / n:>9.1f}%  ({min(counts)}..{max(counts)})")
    tuner = medians["tuner (TPE)"]
    print(f"tuner vs random: {medians['random'] / tuner:.2f}x fewer trials; vs one-at-a-time: "
          f"{medians['one-at-a-time'] / tuner:.2f}x fewer; goal <= 15% of grid: "
          f"{'met' if tuner <= 0.15 * n else 'not met'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure the grid live (slow; resumes)")
    if parser.parse_args().measure:
        measure()
    else:
        replay()
