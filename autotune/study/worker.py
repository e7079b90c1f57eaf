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
from pathlib import Path

import optuna

from autotune.study import driver, objectives, storage
from autotune.study.live import LiveView
from autotune.study.parallel import Fleet, open_storage


def load_options(name: str, url: str) -> tuple[driver.RunOptions, optuna.Study]:
    """The run options the study was created with; ValueError (one line) when there is no such study."""
    if "://" not in url and not Path(url).is_file():
        raise ValueError(f"--storage {url}: no such journal file (a database URL needs a scheme, e.g. postgresql://)")
    try:
        backend = open_storage(url)
        names = optuna.get_all_study_names(backend)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy reports a bad URL or a refused connection in many ways
        raise ValueError(f"cannot open storage {url}: {str(e).splitlines()[0]}") from None
    if name not in names:
        raise ValueError(f"no study {name!r} in {url} (it holds: {', '.join(names) or 'none'}); "
                         f"create it with: autotune run --study {name} --storage {url}")
    study = optuna.load_study(study_name=name, storage=backend)
    recorded = study.user_attrs.get("run_options")
    if not recorded:
        raise ValueError(f"study {name!r} was not created by `autotune run`: it records no run options to join")
    known = {f.name for f in dataclasses.fields(driver.RunOptions)}
    opts = driver.RunOptions(**{k: v for k, v in recorded.items() if k in known})
    return opts, study


def join(name: str, url: str, *, parallel: int | str = "auto", trials: int | None = None, budget: str | None = None,
         gpu: str = "auto", live: bool = True, console=None) -> driver.Outcome:
    """Run trials of study `name` in storage `url` on this machine; returns what the study holds then."""
    opts, study = load_options(name, url)
    budget_s = driver.parse_duration(budget) if budget else None
    if trials is not None and trials < 1:
        raise ValueError("--trials must be at least 1")
    opts = dataclasses.replace(opts, study=name, storage=url, resume=True, parallel=parallel, gpu=gpu, live=live,
                               trials=trials or opts.trials, studies_root=None)
    p = driver.plan(opts)  # this machine's hardware; the study's space, workload and load
    # What is left of the study's budget, counted from its first trial, unless this worker got its own.
    started = min((t.datetime_start.timestamp() for t in study.get_trials(deepcopy=False) if t.datetime_start),
                  default=time.time())
    deadline = time.time() + budget_s if budget_s else (started + opts.budget_s if opts.budget_s else None)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=study._storage,
                              sampler=objectives.make_sampler(opts.objective, seed=None),
                              pruner=objectives.make_pruner(opts.objective))
    (p.directory / "logs").mkdir(parents=True, exist_ok=True)
    if not (p.directory / "provenance.json").exists():
        storage.write_provenance(p.directory / "provenance.json", hardware=p.hardware, engine=opts.engine,
                                 model=opts.model, draft_model=opts.draft_model, workload=opts.workload,
                                 space_source=p.space.source)
    fleet = Fleet(p)
    view = LiveView(opts.objective, {n: q.default for n, q in p.space.params.items()}, console=console, enabled=live)
    if live:
        view.note(f"worker joined study {name} ({url}): {opts.parallel} trial(s) at a time, "
                  f"until {opts.trials} measured trials")
    interrupted = False
    with view, driver.Stop(view) as stop:
        view.show_history(study)
        try:
            fleet.run(study, view, stop, deadline)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            fleet.stop()
            storage.write_trials(study, p.directory / "trials.parquet")
    best, default, gain = driver.summarize(study, opts.objective, p.space.defaults())
    view.summary(best, default, gain, launches=fleet.launches, saved=fleet.saved, directory=p.directory,
                 interrupted=interrupted or stop.requested)
    return driver.Outcome(name, url, p.directory, best, default, gain, fleet.launches, fleet.saved, 0,
                          interrupted or stop.requested)
