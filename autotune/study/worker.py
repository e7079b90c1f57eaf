"""`autotune worker`: join a study that `autotune run --storage URL` created, from this or another
machine, and run its trials until the study holds its trial count or its budget is spent.

The study itself says what to run (its engine, space narrowing, workload, load and objective are
recorded by `autotune run` as the `run_options` study attribute); this machine only adds its own
hardware probe and how many trials it runs side by side. Each worker samples with its own random
seed, so two workers do not propose the same start-up configurations.
"""
from __future__ import annotations

import dataclasses
import time

import optuna

from autotune import provenance
from autotune.study import objectives, optuna_compat, plan, storage
from autotune.study.budget import Budget
from autotune.study.loop import Outcome, run_trials


def load_options(name: str, url: str) -> tuple[plan.RunOptions, optuna.Study]:
    """The run options the study was created with; ValueError (one line) when there is no such study."""
    ctx = storage.load_study(name, url)
    if not ctx.run_options:
        raise ValueError(f"study {name!r} was not created by `autotune run`: it records no run options to join")
    known = {f.name for f in dataclasses.fields(plan.RunOptions)}
    return plan.RunOptions(**{k: v for k, v in ctx.run_options.items() if k in known}), ctx.study


def join(name: str, url: str, *, parallel: int | str = "auto", trials: int | None = None, budget: str | None = None,
         gpu: str = "auto", live: bool = True, console=None, studies_root: str | None = None) -> Outcome:
    """Run trials of study `name` in storage `url` on this machine; returns what the study holds then.
    Its logs and provenance go under `studies_root` of this machine (default: the studies folder)."""
    opts, study = load_options(name, url)
    budget_s = plan.parse_duration(budget) if budget else None
    if trials is not None and trials < 1:
        raise ValueError("--trials must be at least 1")
    opts = dataclasses.replace(opts, study=name, storage=url, resume=True, parallel=parallel, gpu=gpu, live=live,
                               trials=trials or opts.trials, studies_root=studies_root)
    p = plan.build(opts)  # this machine's hardware; the study's space, workload and load
    # What is left of the study's budget, counted from its first trial, unless this worker got its own.
    started = min((t.datetime_start.timestamp() for t in study.get_trials(deepcopy=False) if t.datetime_start),
                  default=time.time())
    spend = Budget(budget_s) if budget_s else (Budget(opts.budget_s, start=started) if opts.budget_s else None)
    study = optuna.load_study(study_name=name, storage=optuna_compat.storage_of(study),
                              sampler=objectives.make_sampler(opts.objective, seed=None),
                              pruner=objectives.make_pruner(opts.objective))
    if not (p.directory / "provenance.json").exists():
        provenance.write(p.directory / "provenance.json", hardware=p.hardware, adapter=p.adapter, model=opts.model,
                         draft_model=opts.draft_model, workload=opts.workload, space_source=p.space.source)
    if live and console is not None:
        console.print(f"worker joined study {name} ({url}): {p.opts.parallel} trial(s) at a time, "
                      + (f"until {opts.trials} measured trials" if opts.trials is not None else "until the budget"))
    return run_trials(p, study, budget=spend, console=console)
