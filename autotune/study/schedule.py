"""Fit a draft-length schedule (batch size -> draft length, 0 = off) from measurements of this machine.

Speculation that wins single-stream loses under load: a verify step of B streams costs more as B grows
while what each stream accepts does not (issue 34). So the draft length is chosen per batch size from
measured throughput, not from a model:

  measurements  rows of (drafter, k, batch, output tok/s): the study's trials that ran the winner's launch
                settings (per load-profile phase where one ran: attrs phase_c<N>_output_tok_s), and a short
                sweep on one running server of the winner (k changed through the adapter's runtime knobs;
                an engine that cannot change k live is relaunched per k) at each batch in `levels`, each cell
                a timed closed-loop phase as a load profile runs one (a cell of a few requests a stream
                ranked otherwise than the load: on an H100, plain decoding beat k=8 by 16% at 16 streams in
                2-request cells and tied it in 4 s phases)
  cells         per (batch, k): the median and a 90% bootstrap interval, widened to +-NOISE_FLOOR
  choice        per batch, the shortest k the best cell does not beat beyond the noise: its median within
                NOISE_FLOOR of the best's and its interval reaching the best's low end (a difference the
                measurements cannot tell is no reason for a longer draft; two wide intervals are no reason
                for a shorter one that measured 8% slower)
  schedule      adjacent batches with the same k merged into rows (draft_schedule.DraftSchedule); a batch
                between two measured ones takes the larger one's k (the cheaper side under load); where
                the prediction puts it within NOISE_FLOOR of the best fixed k, that fixed k instead (one
                row: a schedule that gains nothing measurable is only a risk)
  prediction    on a load profile (phases of concurrency and seconds): overall tok/s of the schedule and
                of every fixed k, each phase at its cell's median (interpolated between measured batches)

The batch a step runs is the number of streams in flight: a closed loop at concurrency c keeps c streams
decoding, so a cell's batch is the concurrency it was measured at.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from autotune.bench import load_workload
from autotune.bench.load_profile import LoadProfile, parse_load_profile
from autotune.bench.load_profile import Phase as ProfilePhase
from autotune.bench.runner import measure_server_profile, warm_up
from autotune.embedded.draft_schedule import DraftSchedule, ScheduleRow
from autotune.engines.launcher import LaunchError, launch
from autotune.space.space import load_space
from autotune.study import record
from autotune.study.budget import Sweep
from autotune.study.storage import StudyContext

CONFIDENCE = 0.90
# Run-to-run noise no interval of few repeats shows: a cell measured once has no spread of its own, and
# relaunches of one configuration on the H200 differed by a few percent (validate's repeats).
NOISE_FLOOR = 0.03
DEFAULT_LEVELS = (1, 2, 4, 8)
DRAFT_GRID = (2, 4, 8)  # the sweep's draft lengths besides 0 and the winner's, inside the space's range
SWEEP_REPEATS = 2
CELL_S = 4.0  # a sweep cell: this long a closed loop at its concurrency (then its requests finish)
PHASE_ATTR = re.compile(r"phase_c(\d+)_output_tok_s")
SCHEDULE_FILE = "draft_schedule.yaml"
FIT_FILE = "draft_schedule_fit.json"  # the table, the choice, the prediction and the trial it was fitted for


@dataclass(frozen=True)
class Measurement:
    drafter: str
    draft_length: int  # 0: plain decoding
    batch: int  # streams in flight (the benchmark's concurrency)
    output_tok_s: float
    accept_length: float | None = None
    step_ms: float | None = None  # time per output token x tokens per step: one step's time
    source: str = "sweep"  # "sweep" or "trial N"


@dataclass(frozen=True)
class Cell:
    batch: int
    draft_length: int
    median: float
    low: float
    high: float
    runs: int
    accept_length: float | None = None
    step_ms: float | None = None


@dataclass(frozen=True)
class Phase:
    concurrency: int
    seconds: float = 1.0


@dataclass(frozen=True)
class Prediction:
    """Overall output tok/s on a load profile: the schedule's and each fixed k's (k = 0 is plain decoding)."""
    schedule_tok_s: float
    fixed_tok_s: dict[int, float]

    @property
    def best_fixed_k(self) -> int:
        return max(self.fixed_tok_s, key=lambda k: (self.fixed_tok_s[k], -k))

    @property
    def ratio(self) -> float:
        return self.schedule_tok_s / self.fixed_tok_s[self.best_fixed_k]


def rows_text(schedule: DraftSchedule) -> str:
    """"1-2: k=8, 3-4: k=4, 5+: off"."""
    parts, low = [], 1
    for i, row in enumerate(schedule.rows):
        last = i == len(schedule.rows) - 1
        span = f"{low}+" if last else (str(low) if low == row.max_batch else f"{low}-{row.max_batch}")
        parts.append(f"{span}: " + (f"k={row.draft_length}" if row.draft_length else "off"))
        low = row.max_batch + 1
    return ", ".join(parts)


@dataclass(frozen=True)
class ScheduleFit:
    schedule: DraftSchedule
    cells: tuple[Cell, ...]
    chosen: dict[int, int]  # batch -> draft length
    prediction: Prediction | None = None
    phases: tuple[Phase, ...] = ()
    trial: int | None = None  # the study's trial whose launch settings were measured
    notes: tuple[str, ...] = field(default_factory=tuple)

    def rows_text(self) -> str:
        return rows_text(self.schedule)

    def summary_line(self) -> str:
        line = f"draft schedule ({self.schedule.drafter}): batch {self.rows_text()}"
        p = self.prediction
        if p:
            line += (f"; predicted {p.schedule_tok_s:.4g} tok/s on the load, {p.ratio:.2f}x the best fixed k "
                     f"(k={p.best_fixed_k}: {p.fixed_tok_s[p.best_fixed_k]:.4g})")
        return line

    def to_json(self) -> dict:
        return {"schedule": self.schedule.model_dump(mode="json"), "cells": [asdict(c) for c in self.cells],
                "chosen": {str(b): k for b, k in self.chosen.items()}, "trial": self.trial,
                "phases": [asdict(p) for p in self.phases], "notes": list(self.notes),
                "prediction": None if self.prediction is None else
                {"schedule_tok_s": self.prediction.schedule_tok_s, "best_fixed_k": self.prediction.best_fixed_k,
                 "ratio": self.prediction.ratio,
                 "fixed_tok_s": {str(k): v for k, v in self.prediction.fixed_tok_s.items()}}}

    @classmethod
    def from_json(cls, doc: dict) -> ScheduleFit:
        pred = doc.get("prediction")
        return cls(DraftSchedule.model_validate(doc["schedule"]), tuple(Cell(**c) for c in doc["cells"]),
                   {int(b): k for b, k in doc["chosen"].items()},
                   pred and Prediction(pred["schedule_tok_s"], {int(k): v for k, v in pred["fixed_tok_s"].items()}),
                   tuple(Phase(**p) for p in doc.get("phases", [])), doc.get("trial"), tuple(doc.get("notes", [])))

    def write(self, directory: Path) -> Path:
        """directory/draft_schedule.yaml (what `autotune serve --draft-schedule` reads) and its fit beside it."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / FIT_FILE).write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return self.schedule.dump(directory / SCHEDULE_FILE)


def read_fit(directory: Path) -> ScheduleFit | None:
    """The fit written in `directory` (a study's best/), or None where none was."""
    path = directory / FIT_FILE
    return ScheduleFit.from_json(json.loads(path.read_text())) if path.is_file() else None


# -- the fit: pure ---------------------------------------------------------------------------------
def interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): a CONFIDENCE bootstrap interval of the median, at least +-NOISE_FLOOR wide."""
    v = np.asarray(values, dtype=float)
    median = float(np.median(v))
    boot = np.median(np.random.default_rng(seed).choice(v, size=(resamples, v.size)), axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail))
    return median, min(low, median * (1 - NOISE_FLOOR)), max(high, median * (1 + NOISE_FLOOR))


def cells_of(measurements: list[Measurement], drafter: str) -> tuple[Cell, ...]:
    """Per (batch, k) of `drafter` (and plain decoding, whoever measured it): median, interval, runs."""
    groups: dict[tuple[int, int], list[Measurement]] = {}
    for m in measurements:
        if m.draft_length == 0 or m.drafter == drafter:
            groups.setdefault((m.batch, m.draft_length), []).append(m)
    cells = []
    for (batch, k), ms in sorted(groups.items()):
        median, low, high = interval([m.output_tok_s for m in ms])
        accept = [m.accept_length for m in ms if m.accept_length is not None]
        steps = [m.step_ms for m in ms if m.step_ms is not None]
        cells.append(Cell(batch, k, median, low, high, len(ms), float(np.median(accept)) if accept else None,
                          float(np.median(steps)) if steps else None))
    return tuple(cells)


def choose(cells: list[Cell]) -> int:
    """The draft length of one batch size: the shortest within the noise of the best (module docstring)."""
    best = max(cells, key=lambda c: c.median)
    return min(c.draft_length for c in cells if c.high >= best.low and c.median >= best.median * (1 - NOISE_FLOOR))


def fit(measurements: list[Measurement], drafter: str, phases: list[Phase] | None = None,
        trial: int | None = None, notes: tuple[str, ...] = ()) -> ScheduleFit:
    """The schedule that maximises measured throughput per batch size; ValueError when nothing was measured."""
    cells = cells_of(measurements, drafter)
    if not cells:
        raise ValueError(f"no measurement of drafter {drafter} or plain decoding to fit a schedule from")
    by_batch: dict[int, list[Cell]] = {}
    for c in cells:
        by_batch.setdefault(c.batch, []).append(c)
    chosen = {b: choose(cs) for b, cs in sorted(by_batch.items())}
    phases = phases or [Phase(b) for b in chosen]
    schedule = schedule_of(drafter, chosen)
    prediction = predict(cells, schedule, phases)
    if prediction and prediction.ratio < 1 + NOISE_FLOOR and len(set(chosen.values())) > 1:
        k = prediction.best_fixed_k
        notes = (*notes, (f"the fitted schedule ({rows_text(schedule)}) was predicted {prediction.ratio:.3f}x "
                          f"fixed k={k}, within the noise: fixed k={k} kept"))
        chosen = dict.fromkeys(chosen, k)
        schedule = schedule_of(drafter, chosen)
        prediction = predict(cells, schedule, phases)
    return ScheduleFit(schedule, cells, chosen, prediction, tuple(phases), trial, notes)


def schedule_of(drafter: str, chosen: dict[int, int]) -> DraftSchedule:
    """Rows from per-batch draft lengths (ascending batches), adjacent equal lengths merged."""
    rows: list[ScheduleRow] = []
    for batch, k in chosen.items():
        if rows and rows[-1].draft_length == k:
            rows[-1] = ScheduleRow(max_batch=batch, draft_length=k)
        else:
            rows.append(ScheduleRow(max_batch=batch, draft_length=k))
    return DraftSchedule(drafter=drafter, rows=tuple(rows))


def predict(cells: tuple[Cell, ...], schedule: DraftSchedule, phases: list[Phase]) -> Prediction | None:
    """Tokens over time on `phases`: each phase at its k's median throughput at its concurrency. Only the
    draft lengths measured at every batch compete as fixed k (None when the schedule's cells lack one)."""
    curves: dict[int, dict[int, float]] = {}
    for c in cells:
        curves.setdefault(c.draft_length, {})[c.batch] = c.median
    batches = sorted({c.batch for c in cells})
    complete = {k: curve for k, curve in curves.items() if sorted(curve) == batches}

    def overall(k_of) -> float | None:
        tokens = seconds = 0.0
        for p in phases:
            curve = curves.get(k_of(p.concurrency))
            if curve is None:
                return None
            xs = sorted(curve)
            tokens += p.seconds * float(np.interp(p.concurrency, xs, [curve[x] for x in xs]))
            seconds += p.seconds
        return tokens / seconds

    fixed = {k: overall(lambda _c, k=k: k) for k in complete}
    scheduled = overall(schedule.length_for)
    if scheduled is None or not fixed:
        return None
    return Prediction(scheduled, fixed)


# -- measurements: the study's trials and the sweep --------------------------------------------------
def study_profile(ctx: StudyContext) -> LoadProfile | None:
    """The load profile the study's trials ran (`--load-profile`), or None."""
    spec = ctx.run_options.get("load_profile")
    return parse_load_profile(spec) if spec else None


def load_varies(ctx: StudyContext) -> bool:
    profile = study_profile(ctx)
    return profile is not None and len(profile.concurrencies()) > 1


def levels_for(profile: LoadProfile | None, concurrency: int | None) -> list[int]:
    """The sweep's concurrencies: the load profile's closed-loop levels, else DEFAULT_LEVELS and the study's."""
    levels = profile.concurrencies() if profile else []
    return levels or sorted({*DEFAULT_LEVELS, int(concurrency or 1)})


def phases_for(profile: LoadProfile | None, levels: list[int]) -> list[Phase]:
    """What the prediction weighs: the profile's timed closed-loop phases, else each level an equal share."""
    timed = [Phase(p.concurrency, p.duration_s) for p in (profile.phases if profile else ())
             if p.rate is None and p.duration_s]
    return timed or [Phase(c) for c in levels]


def drafts(ctx: StudyContext, config: dict) -> bool:
    return ctx.adapter.draft_length(config) > 0


def _launch_part(ctx: StudyContext, config: dict) -> dict:
    """The launch settings apart from the draft length (set to 0 here, so two lengths compare equal)."""
    return ctx.adapter.facts.split_runtime(ctx.adapter.with_draft_length(config, 0))[0]


def from_trials(ctx: StudyContext, config: dict) -> list[Measurement]:
    """What the study measured on `config`'s launch settings: per phase where a load profile ran, else each
    trial's benchmark at the study's concurrency."""
    drafter_key = ctx.adapter.facts.draft_keys[0]
    same = _launch_part(ctx, config)
    out = []
    for t in ctx.study.get_trials(deepcopy=False):
        a = t.user_attrs
        c = a.get("config") or {}
        if not record.is_ok(t) or a.get("status") == record.DUPLICATE or _launch_part(ctx, c) != same:
            continue
        drafter, k = c.get(drafter_key), ctx.adapter.draft_length(c)
        phases = {int(m.group(1)): v for key, v in a.items() if (m := PHASE_ATTR.fullmatch(key)) and v}
        metrics = a.get("metrics") or {}
        if not phases and metrics.get("output_tok_s") and ctx.load.get("concurrency"):
            phases = {int(ctx.load["concurrency"]): metrics["output_tok_s"]}
        out += [Measurement(drafter, k, batch, float(v), source=f"trial {t.number}") for batch, v in phases.items()]
    return out


def draft_grid(adapter, winner_k: int | None = None) -> list[int]:
    """0, the winner's k and DRAFT_GRID inside the range the engine's space gives the draft length (the engine's
    range, not a user's narrowing: the schedule may want a k the search was kept from)."""
    param = load_space(adapter.name).params.get(adapter.facts.draft_keys[1])
    low, high = (param.low, param.high) if param is not None and param.low is not None else (1, max(DRAFT_GRID))
    return sorted({0, *([int(winner_k)] if winner_k else []), *(k for k in DRAFT_GRID if low <= k <= high)})


def planned_sweep(adapter, levels: list[int], max_tokens: int, repeats: int = SWEEP_REPEATS) -> Sweep:
    """What the sweep costs the budget before the winner is known (its own k may add one length): one launch
    where the engine changes k live, else one per k; each cell CELL_S and its last requests' finish."""
    ks = len(draft_grid(adapter)) + 1
    live = adapter.facts.draft_keys[1] in adapter.facts.runtime_params
    return Sweep(1 if live else ks, ks * len(levels) * repeats, CELL_S, max_tokens)


def _config_at(ctx: StudyContext, config: dict, k: int) -> dict:
    """The winner with draft length k; k = 0 through the runtime knob where the engine takes it, else plain."""
    if k or ctx.adapter.facts.draft_keys[1] in ctx.adapter.facts.runtime_params:
        return ctx.adapter.with_draft_length(config, k)
    length_keys = ctx.adapter.with_draft_length({}, 1)  # the settings a draft length is made of
    return {**{key: v for key, v in config.items() if key not in length_keys}, **ctx.adapter.facts.speculation_off}


def sweep(ctx: StudyContext, config: dict, levels: list[int], *, ks: list[int] | None = None,
          repeats: int = SWEEP_REPEATS, cell_s: float = CELL_S,
          max_tokens: int | None = None, launch_timeout_s: float = 300.0, workload=None,
          deadline: float | None = None) -> list[Measurement]:
    """measure_grid on servers of `config`'s launch settings: one, where the engine changes k live. ValueError
    (one line) when a server cannot start or dies."""
    adapter, drafter = ctx.adapter, config[ctx.adapter.facts.draft_keys[0]]
    ks = ks if ks is not None else draft_grid(adapter, adapter.draft_length(config))
    workload = workload or load_workload(ctx.workload, ctx.load.get("seed") or 0)
    max_tokens = max_tokens or ctx.load.get("max_tokens")
    groups: dict[str, list[int]] = {}  # one server per launch configuration
    for k in ks:
        groups.setdefault(json.dumps(_launch_part(ctx, _config_at(ctx, config, k)), sort_keys=True), []).append(k)
    seed, out = ctx.load.get("seed") or 0, []
    for n, group in enumerate(groups.values()):
        first = _config_at(ctx, config, max(group))
        log = ctx.directory / "schedule" / "logs" / f"launch-{n}.log"
        try:
            server = launch(adapter, first, model=ctx.model, draft_model=ctx.draft_model, log_path=log,
                            timeout_s=launch_timeout_s)
        except LaunchError as e:
            raise ValueError(f"schedule sweep: launch {e.kind}: {e.message.splitlines()[0]}") from None
        try:
            # compiling and graph capture at the widest shapes are launch cost, not the first cell's speed
            warm_up(server, workload, concurrency=max(levels), max_tokens=max_tokens, seed=seed,
                    request_timeout=launch_timeout_s)
            out += measure_grid(adapter, server, drafter, {k: _config_at(ctx, config, k) for k in group}, levels,
                                workload=workload, repeats=repeats, cell_s=cell_s, max_tokens=max_tokens,
                                seed=seed, deadline=deadline)
        finally:
            server.stop()
    return out


def measure_grid(adapter, server, drafter: str, configs: dict[int, dict], levels: list[int], *, workload,
                 repeats: int = SWEEP_REPEATS, cell_s: float = CELL_S, max_tokens: int | None = None,
                 seed: int = 0, deadline: float | None = None) -> list[Measurement]:
    """On one running server: each k's runtime settings (`configs[k]`, applied through the adapter) at each
    concurrency, `repeats` times, the k alternated within a repeat and the order flipped every repeat (drift
    falls on every k alike); stops adding cells at `deadline` (time.time())."""
    out = []
    order = sorted(configs)
    for r in range(repeats):
        for c in levels:
            for k in (order if r % 2 == 0 else order[::-1]):
                if deadline is not None and time.time() >= deadline:
                    return out
                adapter.apply_runtime(server.base_url, adapter.facts.split_runtime(configs[k])[1])
                s = measure_cell(server, workload, c, cell_s, max_tokens=max_tokens, seed=seed)
                if not server.alive() or not s.get("completed") or s.get("failed"):
                    raise ValueError(f"schedule sweep: k={k} at concurrency {c}: {s.get('failed')} of "
                                     f"{s.get('sent')} requests failed (see {server.log_path})")
                accept = s.get("accept_length") if k else 1.0
                step = s["tpot_ms_p50"] * accept if s.get("tpot_ms_p50") and accept else None
                out.append(Measurement(drafter, k, c, float(s["output_tok_s"]), accept, step))
    return out


def measure_cell(server, workload, concurrency: int, seconds: float, *, max_tokens: int | None, seed: int = 0) -> dict:
    """One cell: `concurrency` streams kept busy for `seconds`, then drained, as a load profile's phase runs."""
    profile = LoadProfile((ProfilePhase(concurrency=concurrency, duration_s=seconds),))
    return measure_server_profile(server, workload, profile, max_tokens=max_tokens, seed=seed)[0]


def fit_for_study(ctx: StudyContext, config: dict, trial: int | None, *, levels: list[int] | None = None,
                  deadline: float | None = None, **sweep_options) -> ScheduleFit:
    """The winner's schedule: the sweep plus what its trials measured at the sweep's concurrencies, written to
    best/draft_schedule.yaml (and best/draft_schedule_fit.json). ValueError when the winner does not draft."""
    if not drafts(ctx, config):
        raise ValueError("the exported configuration does not draft: no draft-length schedule to fit")
    profile = study_profile(ctx)
    levels = levels or levels_for(profile, ctx.load.get("concurrency"))
    measured = sweep(ctx, config, levels, deadline=deadline, **sweep_options)
    measured += [m for m in from_trials(ctx, config) if m.batch in levels]  # a batch of no sweep has no rival k
    notes = ()
    swept = {(m.batch, m.draft_length) for m in measured if m.source == "sweep"}
    ks = sweep_options.get("ks") or draft_grid(ctx.adapter, ctx.adapter.draft_length(config))
    wanted = {(c, k) for c in levels for k in ks}
    if wanted - swept:
        notes = (f"the sweep measured {len(swept)} of {len(wanted)} cells before the budget's deadline",)
    result = fit(measured, config[ctx.adapter.facts.draft_keys[0]], phases_for(profile, levels), trial, notes)
    result.write(ctx.best_dir)
    return result
