"""Sample efficiency of the tuner on real, recorded grids: trials and seconds to 97 % of a grid's best.

    python3 benchmarks/bench_sample_efficiency.py [--grid CSV ...] [--sampler-seeds 50] [--out DIR]
    python3 benchmarks/bench_sample_efficiency.py --measure [--workload code] [--repeats 3] [--csv CSV]

Replay (no engine runs): each strategy proposes configurations of a grid and gets the grid's recorded
output tok/s as its measurement (a cell measured several times: the median). Cost until a measured cell
reaches 97 % of the grid's best, counted in distinct cells measured (a repeated proposal reuses the result,
as the driver does) and in wall-clock seconds: each cell's recorded benchmark seconds, plus the recorded
launch seconds whenever a launch-time setting changes from the previous cell (a change of runtime knobs
only, e.g. draft_length, reuses the running server, as the driver does). Over --sampler-seeds seeds; the
summary gives medians and 90 % intervals (5th..95th percentiles over sampler seeds).
- TPE, no seeds (the headline): the study's own sampler (autotune.study.objectives.make_sampler), nothing
  enqueued;
- random: cells in a random order, without repeats;
- one-at-a-time (SGLang auto_benchmark's strategy): from the engine defaults, sweep one parameter over its
  values with the others fixed, keep the best, go to the next; two passes; parameter order shuffled per
  sampler seed; never reaching the target counts as measuring the whole grid;
- full grid: every cell once, grouped by launch (what measuring the grid costs).
Reported apart, since the seeds are written by people: the seeds of search_spaces/<engine>.yaml (frozen
before the grids were measured, from documentation and hardware facts) placed on the grid (a numeric value
between measured ones goes to the nearest measured value, and says so; a seed that needs a value the grid
never varied is not on it), their hit rate (share of the placed seeds already within 97 %), and TPE with
those seeds enqueued first.

A grid is a CSV as --measure writes it (benchmarks/data/grid_<engine>_<workload>.csv): '#' comment lines
(the first says how it was measured, including "other settings {...}": the values every cell shares), then
one row per measurement: the varied parameters, then output_tok_s, e2e_ms_p95, accept_length, launch_s,
bench_s, error (and repeat, under the protocol below). The engine is the <engine> of the file name.

Measure (live, slow; resumes): every cell of GRID against a real `autotune serve` on --workload, in
--repeats interleaved rounds (each round measures every cell once, its launch groups in a shuffled order,
one fresh launch per group and round; draft_length changed live), appended to --csv with the engine's
commit in the header: the protocol of issue 13 point 4 (at least three measurements per cell, interleaved).
"""
from __future__ import annotations

import argparse
import ast
import csv
import itertools
import json
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import optuna

from autotune import PROJECT_ROOT
from autotune.space import load_space
from autotune.space.space import SPACES_DIR

DATA = PROJECT_ROOT / "benchmarks" / "data"
OUT = PROJECT_ROOT / "benchmarks" / "results" / "sample-efficiency"
TARGET, SAMPLER_SEEDS, MIN_REPEATS, MIN_GRIDS = 0.97, 50, 3, 3
MEASURES = ("repeat", "output_tok_s", "e2e_ms_p95", "accept_length", "launch_s", "bench_s", "error")
HEADLINE = ("TPE, no seeds", "random", "one-at-a-time", "full grid")
SEEDED = "TPE, frozen seeds first"
# What a grid's file does not say about itself (engine state it was measured at), for the README.
KNOWN = {"grid_embedded_code.csv": "recorded 2026-11-29 by the earlier --measure (one measurement per cell, not "
                                   "interleaved), before the engine's gguf kernel and its W @ x.T change: the engine "
                                   "it measured is not today's, and its commit was not recorded"}

# What --measure runs (the embedded engine, bundled SmolLM2-135M, on a 2-core CPU machine).
GRID = {"drafter": ["none", "ngram", "early_exit"], "draft_length": [2, 4, 8], "dtype": ["float32", "bfloat16"],
        "threads": [1, 2], "verify_slots": [4]}  # 28 cells
LAUNCH = ("drafter", "dtype", "threads", "verify_slots")  # one server per combination; draft_length is live
FIXED = {"draft_policy": "fixed", "ngram_min": 1, "ngram_max": 4, "early_exit_layers": 8, "prefill_ubatch": 256,
         "quantization": "none", "compile": "none", "cuda_graph_batch_sizes": []}
LOAD = {"concurrency": 4, "num_requests": 4, "max_tokens": 32, "warmup": 1}


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# -- a recorded grid ---------------------------------------------------------------------------------
@dataclass
class Cell:
    config: dict  # the varied parameters
    value: float  # output tok/s, median over its measurements
    bench_s: float
    launch_s: float
    measurements: int


@dataclass
class Grid:
    name: str
    path: Path
    engine: str
    header: list[str]
    space: object  # the engine's space narrowed to the grid, everything else pinned as measured
    full_space: object  # the engine's space as shipped (for placing its seeds)
    axes: list[str]
    values: dict[str, list]
    defaults: dict  # the engine default of each axis, as a grid value
    table: dict[tuple, Cell] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds_source: str = ""

    def key(self, config: dict) -> tuple:
        complete = self.space.complete(config)  # pins, defaults; inactive parameters (draft_length off) dropped
        return tuple(complete.get(axis) for axis in self.axes)

    def launch_key(self, key: tuple) -> tuple:
        runtime = self.space.runtime_names()
        return tuple(v for axis, v in zip(self.axes, key) if axis not in runtime)

    def seconds(self, order: list[tuple]) -> float:
        """Wall-clock cost of measuring these cells in this order: benchmarks, plus a launch at each change
        of launch-time settings."""
        total, running = 0.0, None
        for k in order:
            if self.launch_key(k) != running:
                total, running = total + self.table[k].launch_s, self.launch_key(k)
            total += self.table[k].bench_s
        return total

    @property
    def best(self) -> tuple:
        return max(self.table, key=lambda k: self.table[k].value)

    @property
    def goal(self) -> float:
        return TARGET * self.table[self.best].value


def _typed(param, text: str):
    if text in ("", None):
        return None
    if param.type == "int":
        return int(float(text))
    if param.type == "float":
        return float(text)
    if param.type == "batch_sizes":
        return json.loads(text)
    return next((c for c in param.choices if str(c) == text), text)


def read_grid(path: Path) -> Grid:
    lines = path.read_text().splitlines()
    header = [line.lstrip("# ").rstrip() for line in lines if line.startswith("#")]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    match = re.match(r"grid_([a-z0-9]+)_", path.name)
    engine = match.group(1) if match else ""
    if not (SPACES_DIR / f"{engine}.yaml").exists():
        raise ValueError(f"{path.name}: name it grid_<engine>_<workload>.csv with <engine> one of search_spaces/")
    full = load_space(engine)
    axes = [c for c in (rows[0] if rows else {}) if c not in MEASURES]
    unknown = [a for a in axes if a not in full.params]
    if not rows or unknown:
        raise ValueError(f"{path.name}: {'no rows' if not rows else f'columns not in the {engine} space: {unknown}'}")
    pins = {}
    found = re.search(r"other settings (\{.*\})", " ".join(header))
    if found:
        pins = ast.literal_eval(found.group(1))
    notes = []
    values = {}
    for axis in axes:
        p = full.params[axis]
        seen = {_typed(p, r[axis]) for r in rows} - {None}
        values[axis] = [c for c in p.choices if c in seen] if p.type == "categorical" else sorted(seen)
    space = full.narrowed(values)
    params = dict(space.params)
    defaults = {}
    for name, p in params.items():
        if name in axes:
            default = full.params[name].default
            if default not in values[name]:
                if name == "threads" and default is None:  # torch's default: one thread per physical core
                    default = max(values[name])
                    notes.append(f"threads null (torch's default: one thread per physical core) is taken as threads="
                                 f"{default}, the most the grid measured")
                else:
                    notes.append(f"{name}: the engine default {default!r} is not on the grid; {values[name][0]!r} "
                                 "stands in for it")
                    default = values[name][0]
            defaults[name] = default
            params[name] = replace(p, default=default)
        elif not p.pinned:
            if name not in pins:
                notes.append(f"{name} not in the grid's header: taken as the engine default {p.default!r}")
            params[name] = replace(p, fixed=pins.get(name, p.default))
    grid = Grid(path.stem, path, engine, header, replace(space, params=params), full, axes, values, defaults,
                notes=notes)
    has_bench, has_launch = ("bench_s" in rows[0]), ("launch_s" in rows[0])
    grid.seconds_source = ("recorded: bench_s per cell, launch_s per launch" if has_bench and has_launch else
                           "bench_s recorded, launches not counted (no launch_s column)" if has_bench else
                           "not recorded: every cell counted as 1 s, launches not counted")
    measured: dict[tuple, list[dict]] = {}
    for row in rows:
        config = {axis: _typed(full.params[axis], row[axis]) for axis in axes}
        measured.setdefault(grid.key(config), []).append(row)

    def median(rows_, column, empty=0.0):
        numbers = [float(r[column]) for r in rows_ if r.get(column) not in ("", None)]
        return float(np.median(numbers)) if numbers else empty

    for k, rows_ in measured.items():
        grid.table[k] = Cell(dict(zip(axes, k)), median(rows_, "output_tok_s"), median(rows_, "bench_s", 1.0),
                             median(rows_, "launch_s"), len(rows_))
    expected = {grid.key(dict(zip(axes, combo))) for combo in itertools.product(*(values[a] for a in axes))}
    missing = expected - set(grid.table)
    if missing:
        raise ValueError(f"{path.name}: grid incomplete, {len(missing)} cells missing (e.g. "
                         f"{dict(zip(axes, min(missing, key=str)))}); measure them first")
    return grid


# -- strategies: each returns (cells measured in order, whether the last one reached the goal) --------
def run_tpe(grid: Grid, seed: int, seeds: list[dict] = ()) -> tuple[list[tuple], bool]:
    from autotune.study.objectives import make_sampler

    study = optuna.create_study(direction="maximize", sampler=make_sampler("throughput", seed=seed))
    for config in seeds:
        study.enqueue_trial(grid.space.trial_params(config), user_attrs={"seed_config": config})
    order: list[tuple] = []
    for _ in range(40 * len(grid.table)):
        trial = study.ask()
        k = grid.key(grid.space.suggest(trial))
        if k not in order:
            order.append(k)
            if grid.table[k].value >= grid.goal:
                return order, True
            if len(order) == len(grid.table):
                break
        study.tell(trial, grid.table[k].value)
    return order, False


def run_random(grid: Grid, seed: int) -> tuple[list[tuple], bool]:
    cells = sorted(grid.table, key=str)
    random.Random(seed).shuffle(cells)
    n = next(i + 1 for i, k in enumerate(cells) if grid.table[k].value >= grid.goal)
    return cells[:n], True


def run_one_at_a_time(grid: Grid, seed: int) -> tuple[list[tuple], bool]:
    names = [a for a in grid.axes if len(grid.values[a]) > 1]
    random.Random(seed).shuffle(names)
    current = dict(grid.defaults)  # draft_length's default counts once a drafter is on
    order: list[tuple] = []

    def measure(config):
        k = grid.key(config)
        if k not in order:
            order.append(k)
        return grid.table[k].value

    best = measure(current)
    if best >= grid.goal:
        return order, True
    for _ in range(2):  # a second pass, as a patient user would do
        for name in names:
            for value in grid.values[name]:
                candidate = {**current, name: value}
                v = measure(candidate)
                if v >= grid.goal:
                    return order, True
                if v > best:
                    best, current = v, candidate
    return order, False


def full_grid(grid: Grid) -> list[tuple]:
    return sorted(grid.table, key=lambda k: (str(grid.launch_key(k)), str(k)))


def place_seed(grid: Grid, seed: dict) -> tuple[tuple | None, str]:
    """Where a seed of the shipped space lands on the grid: (cell key or None, how)."""
    config = grid.full_space.complete(seed)
    placed, moved = {}, []
    for name, value in config.items():
        p = grid.space.params[name]
        if name in grid.axes:
            if value is None:
                value = grid.defaults[name]
            if value not in grid.values[name]:
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    return None, f"{name}={value} is not on this grid"
                nearest = min(grid.values[name], key=lambda v: (abs(v - value), v))
                moved.append(f"{name} {value} -> {nearest}")
                value = nearest
            placed[name] = value
        elif value != p.fixed:
            return None, f"{name}={value}: the grid has only {name}={p.fixed}"
    return grid.key(placed), ("nearest measured cell: " + ", ".join(moved)) if moved else "on the grid"


# -- replaying ---------------------------------------------------------------------------------------
def stats(numbers: list[float]) -> dict:
    low, high = np.percentile(numbers, [5, 95])
    return {"median": round(float(np.median(numbers)), 2), "interval_90": [round(float(low), 2), round(float(high), 2)]}


def outcome(grid: Grid, runs: list[tuple[list[tuple], bool]]) -> dict:
    everything = grid.seconds(full_grid(grid))
    trials = [len(order) if ok else len(grid.table) for order, ok in runs]  # not reached: the whole grid
    seconds = [grid.seconds(order) if ok else everything for order, ok in runs]
    return {"trials": stats(trials), "seconds": stats(seconds), "reached": sum(ok for _, ok in runs),
            "runs": len(runs)}


def replay_grid(grid: Grid, sampler_seeds: int) -> dict:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seeds = range(sampler_seeds)
    strategies = {
        "TPE, no seeds": outcome(grid, [run_tpe(grid, s) for s in seeds]),
        "random": outcome(grid, [run_random(grid, s) for s in seeds]),
        "one-at-a-time": outcome(grid, [run_one_at_a_time(grid, s) for s in seeds]),
        "full grid": outcome(grid, [(full_grid(grid), True)]),
    }
    placed, enqueue = [], []
    for seed in grid.full_space.seeds:
        k, how = place_seed(grid, seed)
        entry = {"seed": seed, "placement": how}
        if k is not None:
            cell = grid.table[k]
            entry.update(cell=cell.config, tok_s=cell.value, of_best=cell.value / grid.table[grid.best].value,
                         within_target=cell.value >= grid.goal)
            config = grid.space.complete(cell.config)
            if config not in enqueue:
                enqueue.append(config)
        placed.append(entry)
    on_grid = [e for e in placed if "cell" in e]
    hits = [i for i, e in enumerate(on_grid) if e["within_target"]]
    seeded = {"seeds_file": str(Path(grid.full_space.source).relative_to(PROJECT_ROOT)), "seeds": placed,
              "placed": len(on_grid), "not_on_grid": len(placed) - len(on_grid),
              "hit_rate": len(hits) / len(on_grid) if on_grid else None,
              "first_hit_seed": hits[0] + 1 if hits else None,
              SEEDED: outcome(grid, [run_tpe(grid, s, enqueue) for s in seeds])}
    best = grid.table[grid.best]
    defaults = grid.table[grid.key(grid.defaults)]
    repeats = [c.measurements for c in grid.table.values()]
    return {"csv": str(grid.path.relative_to(PROJECT_ROOT)) if grid.path.is_relative_to(PROJECT_ROOT) else str(grid.path),
            "engine": grid.engine, "header": grid.header, "axes": grid.values, "cells": len(grid.table),
            "measurements_per_cell": [min(repeats), max(repeats)],
            "protocol_met": _has_repeat_column(grid.path) and min(repeats) >= MIN_REPEATS,  # --measure's rounds
            "added_in_commit": git("log", "--diff-filter=A", "--format=%h %ad", "--date=short", "--",
                                   str(grid.path)) or None,
            "best": {"cell": best.config, "tok_s": best.value}, "target_tok_s": grid.goal,
            "engine_defaults": {"cell": defaults.config, "tok_s": defaults.value},
            "seconds_source": grid.seconds_source, "notes": grid.notes,
            "strategies": strategies, "seeded": seeded}


def _has_repeat_column(path: Path) -> bool:
    with path.open() as f:
        return "repeat" in next(csv.reader(line for line in f if not line.startswith("#")), [])


def table_lines(name: str, result: dict) -> list[str]:
    best, defaults = result["best"], result["engine_defaults"]
    lo, hi = result["measurements_per_cell"]
    out = [f"### {name}: {result['cells']} cells, {lo if lo == hi else f'{lo}..{hi}'} measurement(s) per cell",
           "",
           (f"Best {best['tok_s']:.2f} tok/s at `{best['cell']}`; target (97 %) {result['target_tok_s']:.2f} tok/s; "
           f"engine defaults {defaults['tok_s']:.2f} tok/s. Seconds: {result['seconds_source']}."),
           "",
           "| strategy | trials to 97 %: median [90 %] | seconds to 97 %: median [90 %] | reached |",
           "| --- | --- | --- | --- |"]

    def row(label, s):
        t, sec = s["trials"], s["seconds"]
        return (f"| {label} | {t['median']:.1f} [{t['interval_90'][0]:.1f}..{t['interval_90'][1]:.1f}] | "
                f"{sec['median']:.0f} [{sec['interval_90'][0]:.0f}..{sec['interval_90'][1]:.0f}] | "
                f"{s['reached']}/{s['runs']} |")

    out += [row(label, result["strategies"][label]) for label in HEADLINE]
    out += ["", ("reached: sampler seeds whose run got to the target; a run that did not (one-at-a-time stuck at a "
            "local best) is charged the whole grid.")]
    seeded = result["seeded"]
    rate = seeded["hit_rate"]
    out += ["", (f"Seeds of `{seeded['seeds_file']}`, reported apart: {seeded['placed']} of "
            f"{seeded['placed'] + seeded['not_on_grid']} land on this grid; seed hit rate "
            f"{'-' if rate is None else f'{rate:.0%}'} (placed seeds already within 97 %)."), "",
            "| seed | placement | cell | tok/s | of best |", "| --- | --- | --- | --- | --- |"]
    for e in seeded["seeds"]:
        out.append(f"| `{e['seed']}` | {e['placement']} | " + (
            f"`{e['cell']}` | {e['tok_s']:.2f} | {e['of_best']:.0%}{' (hit)' if e['within_target'] else ''} |"
            if "cell" in e else "- | - | - |"))
    out += ["", "| strategy (seeded, not the headline) | trials | seconds | reached |", "| --- | --- | --- | --- |",
            row(SEEDED, seeded[SEEDED])]
    return out


def replay(args):
    paths = [Path(g) for g in args.grid] or sorted(DATA.glob("grid_*.csv"))
    results, errors = {}, {}
    for path in paths:
        try:
            grid = read_grid(path)
        except (OSError, ValueError) as e:
            errors[path.name] = str(e)
            print(f"skipped {path.name}: {e}", file=sys.stderr)
            continue
        print(f"{grid.name}: {len(grid.table)} cells, replaying {args.sampler_seeds} sampler seeds ...", flush=True)
        results[grid.name] = replay_grid(grid, args.sampler_seeds)
    if not results:
        sys.exit("no usable grid")
    met = [n for n, r in results.items() if r["protocol_met"]]
    protocol = {"required": f"at least {MIN_GRIDS} recorded grids, each cell measured at least {MIN_REPEATS} times "
                            "interleaved (median), seeds frozen before the grids were measured",
                "grids_meeting_it": met, "met": len(met) >= MIN_GRIDS}
    command = "python3 benchmarks/bench_sample_efficiency.py " + " ".join(
        [f"--grid {p.relative_to(PROJECT_ROOT) if p.is_relative_to(PROJECT_ROOT) else p}" for p in paths] +
        ([f"--sampler-seeds {args.sampler_seeds}"] if args.sampler_seeds != SAMPLER_SEEDS else []))
    dirty = git("status", "--porcelain", "--", "benchmarks/bench_sample_efficiency.py", "search_spaces",
                "autotune/space", "autotune/study/objectives.py")  # what the replay runs
    summary = {"target": TARGET, "sampler_seeds": args.sampler_seeds, "commit": git("rev-parse", "--short", "HEAD"),
               "code_changed_since_commit": bool(dirty), "date": time.strftime("%Y-%m-%d"), "command": command,
               "protocol": protocol, "grids": results, "skipped": errors}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [line for name, r in results.items() for line in [*table_lines(name, r), ""]]
    print("\n".join(lines))
    (out / "README.md").write_text(readme(summary, lines))
    print(f"wrote {out / 'summary.json'} and {out / 'README.md'}")


def readme(summary: dict, tables: list[str]) -> str:
    grids = summary["grids"]
    described = []
    for r in grids.values():
        lo, hi = r["measurements_per_cell"]
        described.append(
            f"- `{r['csv']}` ({r['engine']} engine; added in commit {r['added_in_commit'] or '?'}): "
            f"{lo if lo == hi else f'{lo}..{hi}'} measurement(s) per cell"
            f"{'' if r['protocol_met'] else ' -- does NOT meet the protocol'}. Its header: \"{' '.join(r['header'])}\""
            + (f" Known: {KNOWN[Path(r['csv']).name]}." if Path(r["csv"]).name in KNOWN else "")
            + (" Replay notes: " + "; ".join(r["notes"]) + "." if r["notes"] else ""))
    protocol = summary["protocol"]
    status = "met" if protocol["met"] else "NOT met"
    return "\n".join([
        "# Sample efficiency: trials and seconds to 97 % of a recorded grid's best",
        "",
        (f"Written by `{summary['command']}` at commit {summary['commit']}"
        f"{' (with uncommitted changes to the code)' if summary['code_changed_since_commit'] else ''}, "
        f"{summary['date']}: a replay on recorded measurements, no engine was run. "
        f"{summary['sampler_seeds']} sampler seeds; medians and 90 % intervals (5th..95th percentile over sampler "
        "seeds). How each strategy runs and how seconds are counted: the docstring of "
        "`benchmarks/bench_sample_efficiency.py`. Numbers: `summary.json`."),
        "",
        f"**The protocol of issue 13 point 4 is {status}.** It asks for {protocol['required']}. Grids used here:",
        "",
        *described,
        "",
        ("So these numbers are what the recorded grid(s) say, with a cell's few (here: single) measurements taken "
         "as its truth: a noisy cell can be the 'best', or miss the target, by chance. Open: re-measure the code "
         "grid on today's engine, record the embedded chat grid and a llama.cpp code grid, all with `--measure "
         "--repeats 3` (interleaved rounds, seconds and engine commit recorded), and re-run this replay on them."
         if not protocol["met"] else ""),
        "",
        ("The headline is the first table of each grid: TPE with nothing enqueued against random order, "
        "one-at-a-time and the full grid. The seeds of the search space are scored apart (seed hit rate and "
        "TPE with the seeds first); they were rewritten from public documentation and hardware facts and frozen "
        "on 2026-12-01 (their sources are comments in the YAML), after this grid had been recorded but without "
        "using it."),
        "",
        "## Results",
        "",
        *tables,
        *(["Skipped: " + "; ".join(f"{k}: {v}" for k, v in summary["skipped"].items()), ""] if summary["skipped"] else []),
    ]) + "\n"


# -- measuring ---------------------------------------------------------------------------------------
def cells() -> list[dict]:
    """Every cell of GRID, grouped by launch configuration."""
    out = []
    for launch in itertools.product(*(GRID[name] for name in LAUNCH)):
        cell = dict(zip(LAUNCH, launch))
        for k in (GRID["draft_length"] if cell["drafter"] != "none" else [None]):
            out.append({**cell, "draft_length": k})
    return out


def cell_key(cell: dict) -> tuple:
    return tuple(str(cell.get(k) if cell.get("drafter") != "none" or k != "draft_length" else None) for k in GRID)


def measure(args):
    from autotune.bench import load_workload, run_benchmark
    from autotune.engines import get_adapter
    from autotune.engines.launcher import LaunchError, launch

    path = Path(args.csv) if args.csv else DATA / f"grid_embedded_{args.workload}.csv"
    adapter, workload = get_adapter("embedded"), load_workload(args.workload)
    fields = [*GRID, *MEASURES]
    done = set()
    if path.exists():
        with path.open() as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        if rows and "repeat" not in rows[0]:
            sys.exit(f"{path} predates the protocol (one measurement per cell, no repeat column): give --csv NEW.csv")
        done = {(cell_key({k: (r[k] if r[k] != "" else None) for k in GRID}), int(r["repeat"])) for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--", "autotune") else "")
    new_file = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new_file:
            f.write(f"# `python3 benchmarks/bench_sample_efficiency.py --measure --workload {args.workload} --repeats "
                    f"{args.repeats}`, started {time.strftime('%Y-%m-%d %H:%M %Z')} at engine commit {commit}: "
                    f"embedded engine, bundled SmolLM2-135M, workload {args.workload}, concurrency "
                    f"{LOAD['concurrency']}, {LOAD['num_requests']} requests x {LOAD['max_tokens']} tokens after "
                    f"{LOAD['warmup']} warm-up, {args.repeats} interleaved rounds (every cell once per round, launch "
                    f"groups shuffled, a fresh launch per group and round), one launch per ({', '.join(LAUNCH)}), "
                    f"other settings {FIXED}\n")
            writer.writeheader()
        groups = [list(g) for _, g in itertools.groupby(cells(), key=lambda c: tuple(c[n] for n in LAUNCH))]
        for rep in range(args.repeats):
            order = groups[:]
            random.Random(rep).shuffle(order)
            for group in order:
                todo = [c for c in group if (cell_key(c), rep) not in done]
                todo = todo[rep % len(todo):] + todo[:rep % len(todo)] if todo else []  # rotate draft lengths
                if not todo:
                    continue
                config = {**FIXED, **{n: todo[0][n] for n in LAUNCH},
                          **({"draft_length": todo[0]["draft_length"]} if todo[0]["drafter"] != "none" else {})}
                t0 = time.monotonic()
                try:
                    server = launch(adapter, config, log_path=Path("/tmp") / f"grid-{rep}-{cell_key(todo[0])}.log",
                                    timeout_s=300)
                except LaunchError as e:
                    for cell in todo:
                        writer.writerow({**cell, "repeat": rep, "error": e.kind})
                    continue
                launch_s = time.monotonic() - t0
                try:
                    for cell in todo:
                        if cell["draft_length"] is not None:
                            adapter.apply_runtime(server.base_url, {"draft_length": cell["draft_length"]})
                        t0 = time.monotonic()
                        r = run_benchmark(server.base_url, workload, concurrency=LOAD["concurrency"],
                                          warmup=LOAD["warmup"], num_requests=LOAD["num_requests"],
                                          max_tokens=LOAD["max_tokens"], progress=False)
                        s = r.summary
                        row = {**cell, "repeat": rep, "output_tok_s": round(s["output_tok_s"], 3),
                               "e2e_ms_p95": round(s["e2e_ms_p95"], 1), "accept_length": round(s.get("accept_length") or 0, 3),
                               "launch_s": round(launch_s, 1), "bench_s": round(time.monotonic() - t0, 1),
                               "error": s.get("failed") or ""}
                        writer.writerow(row)
                        f.flush()
                        print(row, flush=True)
                finally:
                    server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="append", default=[], metavar="CSV",
                        help="a recorded grid (repeatable; default: every benchmarks/data/grid_*.csv)")
    parser.add_argument("--sampler-seeds", type=int, default=SAMPLER_SEEDS)
    parser.add_argument("--out", default=str(OUT), help="where summary.json and README.md go")
    parser.add_argument("--measure", action="store_true", help="measure GRID live (slow; resumes)")
    parser.add_argument("--workload", default="code", help="--measure: the workload")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help="--measure: interleaved rounds")
    parser.add_argument("--csv", help="--measure: the grid file (default benchmarks/data/grid_embedded_<workload>.csv)")
    parsed = parser.parse_args()
    measure(parsed) if parsed.measure else replay(parsed)
