"""Sample efficiency of the tuner on real, recorded grids: trials and seconds to 97 % of a grid's best.

    python3 benchmarks/bench_sample_efficiency.py [--grid CSV ...] [--sampler-seeds 50] [--out DIR]
    python3 benchmarks/bench_sample_efficiency.py --measure [--engine embedded|llamacpp] [--workload code] [--repeats 3] [--csv CSV]

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
bench_s, error (and repeat and time, under the protocol below). The engine is the <engine> of the file name.

Measure (live, slow; resumes): every cell of GRIDS[--engine] against a real server of that engine on
--workload, started with autotune.engines.launcher.launch and benchmarked with
autotune.bench.runner.measure_server (the calls a trial makes), in --repeats interleaved rounds: each round
measures every cell once, its launch groups in a shuffled order, one fresh launch per group and round (the
embedded engine's draft_length is changed live; none of llama-server's settings is, so there every cell is
a launch). launch_s is the launch until healthy plus one warm-up request on a prompt the benchmark does not
send; bench_s the cell's runtime change and benchmark. Rows are appended to --csv (default
benchmarks/data/grid_<engine>_<workload>_interleaved.csv) with a time stamp, under a header that records
the command, start time, machine and the engine commit (with any uncommitted changes under autotune/):
the protocol of issue 13 point 4 (at least three measurements per cell, interleaved). The replay's default
is every grid with a repeat column; the older single-measurement grid_embedded_code.csv is superseded.
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
MEASURES = ("repeat", "output_tok_s", "e2e_ms_p95", "accept_length", "launch_s", "bench_s", "error", "time")
HEADLINE = ("TPE, no seeds", "random", "one-at-a-time", "full grid")
SEEDED = "TPE, frozen seeds first"
# What a grid's file does not say about itself (engine state it was measured at), for the README.
KNOWN = {"grid_embedded_code.csv": "recorded 2026-11-29 by the earlier --measure (one measurement per cell, not "
                                   "interleaved), before the engine's gguf kernel and its W @ x.T change: the engine "
                                   "it measured is not today's, and its commit was not recorded",
         "grid_llamacpp_code_interleaved.csv": "parallel empty (None) is llama-server's auto, which its log reports "
                                               "as 4 slots with a unified KV cache; threads 2 is what its default "
                                               "(-1) runs here, one thread per physical core"}


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
    samples: dict = field(default_factory=dict)  # round (repeat) -> output tok/s, where the grid has rounds


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
    rows: list[dict] = field(default_factory=list)

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
        seen = {_typed(p, r[axis]) for r in rows}
        if not (p.type == "categorical" and None in p.choices):  # None there is a value (llama.cpp's parallel auto)
            seen -= {None}  # else: the parameter is inactive in that row (draft_length without a drafter)
        values[axis] = [c for c in p.choices if c in seen] if p.type == "categorical" else sorted(seen)
    space = full.narrowed(values)
    params = dict(space.params)
    defaults = {}
    for name, p in params.items():
        if name in axes:
            default = full.params[name].default
            if default not in values[name]:
                if name == "threads" and default is None:  # torch's and llama.cpp's: one thread per physical core
                    default = max(values[name])
                    notes.append(f"threads null (the engine's default: one thread per physical core) is taken as "
                                 f"threads={default}, the most the grid measured")
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
        ok = [r for r in rows_ if r.get("output_tok_s") not in ("", None)]
        grid.table[k] = Cell(dict(zip(axes, k)), median(rows_, "output_tok_s"), median(rows_, "bench_s", 1.0),
                             median(rows_, "launch_s"), len(ok),
                             {int(r["repeat"]): float(r["output_tok_s"]) for r in ok if r.get("repeat") not in ("", None)})
    grid.rows = rows
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


def noise(grid: Grid) -> dict | None:
    """Between rounds: each cell's spread (max - min over its rounds, over its median), each round's level
    (mean over cells of the round's value over the cell's median), which cell is best in each round."""
    cells = {k: c for k, c in grid.table.items() if len(c.samples) >= 2 and c.value > 0}
    if not cells:
        return None
    spread = [(max(c.samples.values()) - min(c.samples.values())) / c.value for c in cells.values()]
    rounds = sorted({r for c in cells.values() for r in c.samples})
    level = {r: round(float(np.mean([c.samples[r] / c.value for c in cells.values() if r in c.samples])), 3)
             for r in rounds}  # a mean: with 3 rounds one round of each cell is its median, a median would say 1
    best_each = {}
    for r in rounds:
        have = {k: c.samples[r] for k, c in cells.items() if r in c.samples}
        best_each[r] = max(have, key=have.get)
    best = grid.best
    return {"relative_spread": {"median": round(float(np.median(spread)), 3),
                                "p90": round(float(np.percentile(spread, 90)), 3), "max": round(max(spread), 3)},
            "round_level": level,
            "best_cell_each_round": {r: grid.table[k].config for r, k in best_each.items()},
            "rounds_where_the_median_best_is_best": sum(k == best for k in best_each.values()),
            "rounds": len(rounds),
            "cells_within_target": sum(c.value >= grid.goal for c in grid.table.values()),
            "best_cell_rounds_within_target": sum(v >= grid.goal for v in grid.table[best].samples.values())}


def best_by_value(grid: Grid) -> dict:
    """For each axis and value: the best cell's median with that value, over the grid's best (what an axis
    is worth on this grid)."""
    top = grid.table[grid.best].value
    out = {}
    for i, axis in enumerate(grid.axes):
        out[axis] = {str(v): round(max(c.value for k, c in grid.table.items() if k[i] == v) / top, 3)
                     for v in grid.values[axis]}
    return out


def measured(grid: Grid) -> dict | None:
    """When the grid was measured and how long it took (from the rows' time column)."""
    stamped = [r for r in grid.rows if r.get("time")]
    if not stamped:
        return None
    parse = lambda t: time.mktime(time.strptime(t, "%Y-%m-%dT%H:%M:%S"))
    first, last = min(stamped, key=lambda r: r["time"]), max(stamped, key=lambda r: r["time"])
    lead = sum(float(first.get(c) or 0) for c in ("launch_s", "bench_s"))  # the first row is written after both
    start = parse(first["time"]) - lead
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start)), "finished": last["time"],
            "wall_s": round(parse(last["time"]) - start), "rows": len(grid.rows),
            "failed_rows": sum(1 for r in grid.rows if r.get("output_tok_s") in ("", None)),
            "rows_with_failed_requests": sum(1 for r in grid.rows if r.get("error") not in ("", None, "0"))}


def engine_commit(header: list[str]) -> dict:
    text = " ".join(header)
    found = re.search(r"engine commit ([0-9a-f]{7,40})", text)
    dirty = re.search(r"with uncommitted changes to (.*?), on a", text)
    return {"commit": found.group(1) if found else None, "uncommitted": dirty.group(1).split(", ") if dirty else []}



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
            "engine_commit": engine_commit(grid.header), "measured": measured(grid), "noise": noise(grid),
            "best_by_value": best_by_value(grid),
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
           ("The best cell with each value, over the grid's best: " + "; ".join(
               f"{axis} " + ", ".join(f"{v} {share:.0%}" for v, share in shares.items())
               for axis, shares in result["best_by_value"].items()) + "."),
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
    every = sorted(DATA.glob("grid_*.csv"))
    paths = [Path(g) for g in args.grid] or [p for p in every if _has_repeat_column(p)]
    superseded = {p.name: KNOWN.get(p.name, "no repeat column: recorded before the protocol")
                  for p in every if p not in paths and not _has_repeat_column(p)}
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
               "protocol": protocol, "grids": results, "skipped": errors,
               "superseded_not_replayed": superseded}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [line for name, r in results.items() for line in [*table_lines(name, r), ""]]
    print("\n".join(lines))
    (out / "README.md").write_text(readme(summary, lines))
    print(f"wrote {out / 'summary.json'} and {out / 'README.md'}")


def _interval(s: dict, digits: int) -> str:
    lo, hi = s["interval_90"]
    return f"{s['median']:.{digits}f} [{lo:.{digits}f}..{hi:.{digits}f}]"


def _minutes(seconds) -> str:
    return f"{seconds / 60:.0f} min" if seconds is not None else "?"


def readme(summary: dict, tables: list[str]) -> str:
    grids = summary["grids"]
    described = []
    for r in grids.values():
        lo, hi = r["measurements_per_cell"]
        commit, when = r["engine_commit"], r["measured"]
        described.append(
            f"- `{r['csv']}` ({r['engine']} engine; {r['cells']} cells, "
            f"{lo if lo == hi else f'{lo}..{hi}'} measurement(s) per cell; engine commit "
            f"{commit['commit'] or 'not recorded'}"
            + (f" with uncommitted changes to {', '.join(commit['uncommitted'])}"
               if commit["uncommitted"] else "")
            + (f"; measured {when['started']}..{when['finished']}, {_minutes(when['wall_s'])} of wall time"
               + (f", {when['failed_rows']} failed row(s)" if when["failed_rows"] else "")
               + (f", {when['rows_with_failed_requests']} row(s) with failed requests (kept: their tok/s counts "
                  "the requests that finished)" if when.get("rows_with_failed_requests") else "") if when else "")
            + f"){'' if r['protocol_met'] else ' -- does NOT meet the protocol'}. Its header: \"{' '.join(r['header'])}\""
            + (f" Known: {KNOWN[Path(r['csv']).name]}." if Path(r["csv"]).name in KNOWN else "")
            + (" Replay notes: " + "; ".join(r["notes"]) + "." if r["notes"] else ""))
    protocol = summary["protocol"]
    status = "met, as counted (grids, rounds, frozen seeds)" if protocol["met"] else "NOT met"
    spreads = {n: r["noise"]["relative_spread"]["median"] for n, r in grids.items() if r["noise"]}
    wide = {n: v for n, v in spreads.items() if v > 1 - TARGET}
    caution = ("**But the noise is wider than the target's margin:** the median spread between a cell's rounds is "
               + ", ".join(f"{v:.0%} ({n})" for n, v in wide.items())
               + f", against the {1 - TARGET:.0%} between the best and the target. Which cell is 'the best' changes "
                 "from round to round (the noise table), so the trials to 97 % below measure how long a strategy "
                 "takes to hit the cell with the luckiest median as much as how well it searches.") if wide else ""
    headline = ["| grid | strategy | trials to 97 %: median [90 %] | seconds to 97 %: median [90 %] | reached |",
                "| --- | --- | --- | --- | --- |"]
    for name, r in grids.items():
        for label in HEADLINE:
            st = r["strategies"][label]
            headline.append(f"| {name} | {label} | {_interval(st['trials'], 1)} | {_interval(st['seconds'], 0)} | "
                            f"{st['reached']}/{st['runs']} |")
    seeds = ["| grid | seeds on the grid | seed hit rate | first hit | TPE, frozen seeds first: trials | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in grids.items():
        sd, st = r["seeded"], r["seeded"][SEEDED]
        rate = "-" if sd["hit_rate"] is None else f"{sd['hit_rate']:.0%}"
        seeds.append(f"| {name} | {sd['placed']} of {sd['placed'] + sd['not_on_grid']} | {rate} | "
                     f"{sd['first_hit_seed'] or '-'} | {_interval(st['trials'], 1)} | {_interval(st['seconds'], 0)} |")
    noisy = [("| grid | relative spread per cell: median (p90, max) | each round's level | median-best cell best in | "
              "its rounds within 97 % | cells within 97 % |"), "| --- | --- | --- | --- | --- | --- |"]
    for name, r in grids.items():
        n = r["noise"]
        if not n:
            noisy.append(f"| {name} | one measurement per cell | - | - | - | - |")
            continue
        sp = n["relative_spread"]
        noisy.append(f"| {name} | {sp['median']:.0%} ({sp['p90']:.0%}, {sp['max']:.0%}) | "
                     + " / ".join(f"{v:.2f}" for v in n["round_level"].values())
                     + f" | {n['rounds_where_the_median_best_is_best']} of {n['rounds']} rounds | "
                       f"{n['best_cell_rounds_within_target']} of {n['rounds']} | {n['cells_within_target']} of {r['cells']} |")
    superseded = summary.get("superseded_not_replayed") or {}
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
        *(["", caution] if caution else []),
        *([""] + [f"Superseded, not replayed: `benchmarks/data/{k}` ({v}). The grids above are the protocol's."
                  for k, v in superseded.items()] if superseded else []),
        "",
        ("A cell's value is the median of its rounds. The machine is a shared 2-core CPU: every grid was measured "
         "while tests and other benchmarks ran on it, so a round's level moves with that load (the noise table), "
         "and interleaving the rounds spreads that load over all cells instead of over a few. "
         "The seeds of the search spaces (`search_spaces/*.yaml`) were written from public documentation and "
         "hardware facts and frozen before these grids were measured (their sources are comments in the YAML); "
         "they are scored apart, never in the headline."),
        "",
        "## Headline: TPE without seeds vs random vs one-at-a-time vs the full grid",
        "",
        *headline,
        "",
        ("reached: sampler seeds whose run got to 97 % of the grid's best; a run that did not (one-at-a-time stuck "
         "at a local best) is charged the whole grid. Seconds: recorded benchmark seconds per cell plus recorded "
         "launch seconds (launch, health, one warm-up request) whenever a launch-time setting changes."),
        "",
        "## Seeds, reported apart",
        "",
        *seeds,
        "",
        "seed hit rate: the share of the seeds that land on the grid whose cell is already within 97 % of the best.",
        "",
        "## Noise between rounds",
        "",
        *noisy,
        "",
        ("relative spread: (largest - smallest of a cell's rounds) / its median. each round's level: the mean over "
         "cells of the round's value over the cell's median (the machine's load drifting between rounds). A spread "
         "wider than the 3 % between the target and the best means the target is inside the noise: which cells "
         "count as 'within 97 %' is itself uncertain, and the trial counts above inherit it."),
        "",
        "## Limits",
        "",
        ("- Each grid is a slice of its engine's space: the axes in its table heading below, every other setting "
         "pinned (its header's 'other settings'). The replay's TPE searches that slice (the space narrowed to the "
         "grid), not the whole space, so trials to the target on the whole space would be more."),
        ("- One small load per grid (its header: concurrency, requests x tokens), one model, one machine: a "
         "shared 2-core CPU whose load from other work changed during the measurement."),
        ("- A grid's best is the best median of a few noisy rounds: when the spread between rounds is wider than "
         "3 %, another cell may truly be the best, and 'within 97 %' is a noisy line."),
        "",
        "## Per grid",
        "",
        *tables,
        *(["Skipped: " + "; ".join(f"{k}: {v}" for k, v in summary["skipped"].items()), ""] if summary["skipped"] else []),
    ]) + "\n"


# -- measuring ---------------------------------------------------------------------------------------
@dataclass
class GridSpec:
    """What --measure runs for one engine: the varied parameters (in the space's declaration order), the
    settings every cell shares (pinned over the engine defaults), and a line on the model it serves."""
    axes: dict[str, list]
    fixed: dict
    model: str


GRIDS = {
    # 16 cells, 8 launches a round: drafter x quantization x threads, draft_length changed live. dtype stays
    # float32 (the gguf kernel runs float32 only, so dtype x quantization is not a full product).
    "embedded": GridSpec({"drafter": ["none", "ngram"], "draft_length": [2, 5, 10], "quantization": ["none", "gguf"],
                          "threads": [1, 2]},
                         {"draft_policy": "fixed", "ngram_min": 1, "ngram_max": 4, "early_exit_layers": 8,
                          "verify_slots": 4, "prefill_ubatch": 256, "dtype": "float32", "compile": "none",
                          "cuda_graph_batch_sizes": []},
                         "bundled SmolLM2-135M-Instruct (safetensors; quantization gguf: its Q4_1 GGUF's blocks)"),
    # 20 cells, every one a launch (no llama-server setting changes on a running server). parallel null is
    # the server's auto: 4 slots, unified KV cache; threads null would be its default, one per physical core.
    "llamacpp": GridSpec({"spec_type": ["none", "ngram-simple", "ngram-mod"], "spec_ngram_simple_size_n": [3, 6, 12],
                          "parallel": [None, 1], "threads": [1, 2]},
                         {},
                         "bundled SmolLM2-135M-Instruct Q4_1 GGUF"),
}
LOAD = {"concurrency": 4, "num_requests": 4, "max_tokens": 32, "warmup": 1}


def measure_cells(engine: str) -> list[dict]:
    """Every cell of GRIDS[engine]: the product of its axes with parameters inactive in a cell (draft_length
    without a drafter) left out, grouped by launch-time settings."""
    space, spec = load_space(engine), GRIDS[engine]
    out = []
    for combo in itertools.product(*spec.axes.values()):
        wanted, cell = dict(zip(spec.axes, combo)), {}
        for p in space.params.values():  # declaration order: `when` names earlier parameters
            if p.name in wanted and space.active(p, {**spec.fixed, **cell}):
                cell[p.name] = wanted[p.name]
        if cell not in out:
            out.append(cell)
    launch = launch_axes(engine)
    return sorted(out, key=lambda c: [str(c.get(a)) for a in launch])  # stable within a group: axes order


def launch_axes(engine: str) -> list[str]:
    return [a for a in GRIDS[engine].axes if a not in load_space(engine).runtime_names()]


def cell_key(engine: str, cell: dict) -> tuple:
    return tuple("" if cell.get(a) is None else str(cell.get(a)) for a in GRIDS[engine].axes)


def machine() -> str:
    import os
    import platform

    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return (f"{os.cpu_count()}-core {model or platform.machine()} CPU, shared with other work (tests and other "
            f"benchmarks ran on it at the same time; load average {os.getloadavg()[0]:.1f} at the start)")


def measure(args):
    from autotune.bench import load_workload
    from autotune.bench.runner import measure_server
    from autotune.bench.workloads import Workload
    from autotune.engines import get_adapter
    from autotune.engines.launcher import LaunchError, launch

    engine, spec = args.engine, GRIDS[args.engine]
    path = Path(args.csv) if args.csv else DATA / f"grid_{engine}_{args.workload}_interleaved.csv"
    adapter, workload = get_adapter(engine), load_workload(args.workload)
    warm = Workload(workload.name, workload.requests[-LOAD["warmup"]:])  # not the prompts measured (prompt caches)
    space, launch_names = load_space(engine), launch_axes(engine)
    fields = [*spec.axes, *MEASURES]
    done = set()
    if path.exists():
        with path.open() as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        if rows and "repeat" not in rows[0]:
            sys.exit(f"{path} predates the protocol (one measurement per cell, no repeat column): give --csv NEW.csv")
        if rows and list(rows[0]) != fields:
            sys.exit(f"{path}: columns {list(rows[0])} are not this grid's {fields}: give --csv NEW.csv")
        done = {(tuple(r[a] for a in spec.axes), int(r["repeat"])) for r in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", "HEAD")
    dirty = [line.split(maxsplit=1)[1] for line in git("status", "--porcelain", "--", "autotune").splitlines()]
    pins = {name: spec.fixed.get(name, p.default) for name, p in space.params.items() if name not in spec.axes}
    all_cells = measure_cells(engine)
    groups = [list(g) for _, g in itertools.groupby(all_cells, key=lambda c: tuple(c.get(n) for n in launch_names))]
    version = adapter.installed_version() if hasattr(adapter, "installed_version") else None
    new_file = not path.exists()
    logs = Path("/tmp") / "autotune-grid-logs"
    logs.mkdir(exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new_file:
            f.write(f"# `python3 benchmarks/bench_sample_efficiency.py --measure --engine {engine} --workload "
                    f"{args.workload} --repeats {args.repeats}`, started {time.strftime('%Y-%m-%d %H:%M %Z')} at "
                    f"engine commit {commit}"
                    f"{' with uncommitted changes to ' + ', '.join(dirty) if dirty else ''}, on a {machine()}: "
                    f"{engine} engine{f' (build {version})' if version and engine != 'embedded' else ''}, "
                    f"{spec.model}, workload {args.workload}, concurrency {LOAD['concurrency']}, "
                    f"{LOAD['num_requests']} requests x {LOAD['max_tokens']} tokens per cell "
                    f"(autotune.bench.runner.measure_server, as a trial measures), servers started by "
                    f"autotune.engines.launcher.launch; {len(all_cells)} cells, {args.repeats} interleaved rounds "
                    f"(every cell once per round, launch groups in a shuffled order, a fresh launch per group and "
                    f"round), one launch per ({', '.join(launch_names)}); launch_s = the launch until healthy plus "
                    f"{LOAD['warmup']} warm-up request (not measured) on another prompt; bench_s = the cell's "
                    f"runtime change and benchmark; other settings {pins}\n")
            writer.writeheader()
        for rep in range(args.repeats):
            order = groups[:]
            random.Random(rep).shuffle(order)
            for group in order:
                todo = [c for c in group if (cell_key(engine, c), rep) not in done]
                todo = todo[rep % len(todo):] + todo[:rep % len(todo)] if todo else []  # rotate runtime values
                if not todo:
                    continue
                config = space.complete({**spec.fixed, **todo[0]})
                t0 = time.monotonic()
                try:
                    server = launch(adapter, config, log_path=logs / f"{path.stem}-r{rep}-{'-'.join(cell_key(engine, todo[0]))}.log",
                                    timeout_s=300)
                except LaunchError as e:
                    for cell in todo:
                        writer.writerow({**cell, "repeat": rep, "error": e.kind,
                                         "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
                    f.flush()
                    print(f"launch failed ({e.kind}): {e}", flush=True)
                    continue
                try:
                    measure_server(server, warm, concurrency=1, num_requests=LOAD["warmup"],
                                   max_tokens=LOAD["max_tokens"], seed=0)
                    launch_s = time.monotonic() - t0
                    for cell in todo:
                        t0 = time.monotonic()
                        runtime = {k: v for k, v in space.complete({**spec.fixed, **cell}).items()
                                   if k in space.runtime_names()}
                        if runtime and cell is not todo[0]:
                            adapter.apply_runtime(server.base_url, runtime)
                        s, _ = measure_server(server, workload, concurrency=LOAD["concurrency"],
                                              num_requests=LOAD["num_requests"], max_tokens=LOAD["max_tokens"], seed=0)
                        row = {**cell, "repeat": rep, "output_tok_s": round(s["output_tok_s"], 3),
                               "e2e_ms_p95": round(s["e2e_ms_p95"], 1),
                               "accept_length": round(s.get("accept_length") or 0, 3),
                               "launch_s": round(launch_s, 1), "bench_s": round(time.monotonic() - t0, 1),
                               "error": s.get("failed") or "", "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
                        writer.writerow(row)
                        f.flush()
                        print(row, flush=True)
                finally:
                    server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="append", default=[], metavar="CSV",
                        help="a recorded grid (repeatable; default: every benchmarks/data/grid_*.csv recorded under "
                             "the protocol, i.e. with a repeat column)")
    parser.add_argument("--sampler-seeds", type=int, default=SAMPLER_SEEDS)
    parser.add_argument("--out", default=str(OUT), help="where summary.json and README.md go")
    parser.add_argument("--measure", action="store_true", help="measure GRIDS[--engine] live (slow; resumes)")
    parser.add_argument("--engine", default="embedded", choices=sorted(GRIDS), help="--measure: the engine")
    parser.add_argument("--workload", default="code", help="--measure: the workload")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help="--measure: interleaved rounds")
    parser.add_argument("--csv", help="--measure: the grid file (default "
                                      "benchmarks/data/grid_<engine>_<workload>_interleaved.csv)")
    parsed = parser.parse_args()
    measure(parsed) if parsed.measure else replay(parsed)
