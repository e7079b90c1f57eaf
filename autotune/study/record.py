"""The trial record: what every trial of a study stores in Optuna's `user_attrs`, written by the trial
loop (autotune/study/trial.py) and read by validation, export, the report, ci and the estimator.

Optuna keeps user attrs as JSON, so the record is a TypedDict over plain data; `record(trial)` reads it.
"""
from __future__ import annotations

import json
from typing import TypedDict

from optuna.trial import FrozenTrial, TrialState

from autotune.bench.runner import json_ready  # noqa: F401 - how a record's values become JSON, re-exported

# user_attrs["status"]: what happened, in words
OK = "ok"  # measured, every requirement met
INFEASIBLE = "infeasible"  # measured, but an SLO was missed or requests failed
PRUNED = "pruned"  # its quick measurement was hopeless (or timed out)
REJECTED = "rejected"  # an engine rule, a hardware condition or the memory model refused it before launch
FAILED = "failed"  # the engine crashed, ran out of memory, did not come up, or died mid-benchmark
DUPLICATE = "duplicate"  # the engine would run exactly what an earlier trial ran: its result is copied
INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM while it ran
BUDGET = "budget"  # cut at the run's search deadline (--budget): no verdict on its configuration (Optuna: FAIL)
NOT_RUN = "not_run"  # queued in the storage, but nobody reached it (studies before the lazy seed queue: resumed)




class TrialRecord(TypedDict, total=False):
    status: str  # one of the constants above
    original_status: str  # a duplicate: the status of the trial it copies
    duplicate_of: int  # a duplicate: that trial's number
    config: dict  # the configuration asked, in the engine's option names
    seed_config: dict  # set when the trial was queued: the configuration it was queued with
    predicted: dict  # a seed from the analytical model: its memory and speed prediction
    warm_start: str  # a seed from `autotune ci`'s re-tune: the study it came from
    remembered_from: str  # a failure copied from an earlier study by `autotune ci`
    effective: dict  # what the engine would really run (adapter.effective): defaults and inert flags dropped
    effective_key: str  # that, as canonical JSON: equal keys = the same engine run (dedupe)
    measured: bool  # a launch was attempted: counts towards --trials
    memory: dict  # the memory model's verdict (MemoryEstimate.record())
    violations: list  # rejected: every rule / hardware / memory reason
    failure_kind: str  # rule | hardware | memory | oom | crash | timeout | bench | errors | slo | stale
    failure: str  # one line: why it failed, was pruned or is infeasible
    log_tail: str  # a failed launch: the end of the engine's log
    launch: str  # launched | reused (a running server took the runtime knobs)
    argv: list  # the engine's command line
    env: dict  # environment the engine was started with
    placement: dict  # GPUs / threads given to it by the packer
    log: str  # path of the engine's log
    runtime: dict  # reused: the runtime knobs applied to the running server
    warmup_s: float  # seconds of warm-up before any measurement (compiling, CUDA-graph capture): launch cost
    warmup_waves_s: list  # each warm-up wave's seconds (waves go on while they get markedly faster)
    quick: dict  # the quick first measurement's benchmark summary
    metrics: dict  # the full benchmark's summary (autotune/bench/metrics.py): output_tok_s, e2e_ms_p95, ...
    requests_file: str  # per-request parquet of the full benchmark
    timings: dict  # launch_s, compile_s, warmup_s, quick_s, bench_requests, bench_rounds, bench_s, total_s


def record(trial: FrozenTrial) -> TrialRecord:
    return trial.user_attrs  # type: ignore[return-value]


def is_ok(trial: FrozenTrial) -> bool:
    """Measured and met every requirement, by itself or as a duplicate of a trial that did."""
    r = record(trial)
    status = r.get("original_status") if r.get("status") == DUPLICATE else r.get("status")
    return trial.state == TrialState.COMPLETE and status == OK


def effective_key(adapter, config: dict) -> str:
    """Canonical JSON of what the engine would run: two configurations with one key are one run."""
    return json.dumps(adapter.effective(config), sort_keys=True, default=str)
