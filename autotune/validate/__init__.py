"""Validation: relaunch a study's best configurations fresh, benchmark each several times, and pick the
winner that is fast, steady, within every SLO and faithful to the baseline's greedy output.

A study measures each configuration once, on a server that may have been reused; the best of many noisy
measurements is biased upwards (the winner's curse). So the top K distinct configurations (and the
baseline: the study's engine-defaults trial, else the engine's own defaults) each get a fresh launch, a
warm-up and N benchmarks of the study's load (measure.py); a repeat added to one of a launch's runtime
variants is a launch of all of them, so they stay paired. Each metric's spread and each gain beyond the
noise come from statistics.py; greedy outputs are compared with the baseline's in quality.py.

Speculation makes runs vary, so the number of repeats follows the measured spread (race.py): while the
winner does not beat the runner-up and the baseline beyond the noise (the 90% interval of its gain,
Welch t on log values, excludes 1.0), each of them gets one more repeat on one more fresh launch, up to
a cap. A race still open at the cap is a tie: both are in validation.json and the one with fewer
settings changed from the engine defaults is exported. A race the budget ends before the cap is a tie
too, but the evidence is not in: the fastest by median is exported (on the H200 the simpler of such a
pair ran 5% slower, benchmarks/results/h200-2026-12-03c).

`validate(study)` (run.py; its defaults: settings.py `ValidationSettings`) writes
studies/<name>/best/validation.json (record.py: `Validation`, read back with `Validation.load`) and the
per-request tables of every repeat to studies/<name>/validation/<label>-repeat-<r>.parquet.
"""