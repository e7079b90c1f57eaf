"""Fit the speed model's coefficients and acceptance rates to the trials a study has measured.

A trial is a dict: {"config": {...}, "concurrency": N, and either "decode_tok_s" (one stream's decode
rate, the median over requests) or "output_tok_s" (all output tokens over the benchmark's wall time,
prefill included) with "prompt_tokens", "output_tokens", "num_requests"; optional "accept_length"
(tokens per verify step as the engine reports it) and "context_len"}. `trial_from_metrics` builds one
from a study trial's config and its bench summary.

Fit: least squares on log time over the six Coefficients (bytes, FLOPs, per-step overhead, per-kernel
floor, per-kernel eager launch, per-speculative-step host work), with a weak pull (ridge in log space) towards the priors so that a
handful of trials cannot send an unconstrained term anywhere; a coarse log grid refined three times
(numpy only). The study refits after its first measured trials (autotune/study/loop.py), so a small
model's kernel-bound steps replace the byte-bound priors before the predicted seeds are chosen. Acceptance per
drafter family: the family's per-position prior (acceptance.py) keeps its decay, and its first-position rate
becomes the median of those that reproduce each trial's measured accept length at the trial's own shape.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from autotune.predict.acceptance import drafter_acceptance, expected_tokens, scaled_to
from autotune.predict.knobs import Engine
from autotune.predict.models import ModelSpec
from autotune.predict.speed import Coefficients, Pass, decode_step, default_coefficients, prefill_passes

NAMES = ("mem_scale", "compute_scale", "step_overhead_s", "kernel_s", "launch_s", "spec_step_s")
GRID_POINTS = 7  # per coefficient and refinement: 7^6 = 117649 candidates
RIDGE = 0.02  # weight of (log coefficient - log prior)^2 against the squared log errors


def trial_from_metrics(config: dict, metrics: dict, concurrency: int) -> dict:
    """A study trial (user_attrs config + bench summary) as a calibration trial."""
    return {"config": config, "concurrency": concurrency, "decode_tok_s": metrics.get("decode_tok_s_p50"),
            "output_tok_s": metrics.get("output_tok_s"), "accept_length": metrics.get("accept_length"),
            "prompt_tokens": metrics.get("prompt_tokens_mean"), "output_tokens": metrics.get("output_tokens_mean"),
            "num_requests": metrics.get("completed")}


def trial_passes(trial: dict, model: ModelSpec, profile, engine: Engine, alphas: dict,
                 draft: ModelSpec | None = None) -> tuple[list[tuple[float, Pass]], float, str]:
    """(passes with their counts, tokens they produce, measured key) of one trial: predicted tok/s =
    tokens / sum(count x pass seconds)."""
    k = engine.knobs(trial["config"], bool(profile is not None and profile.is_gpu))
    if trial.get("accept_length") and k.drafter:
        per_step = float(trial["accept_length"])
    else:
        per_step = expected_tokens(drafter_acceptance(k.drafter, model.mtp_layers, alphas.get(k.drafter)), k) \
            if k.drafter else 1.0
    conc = int(trial.get("concurrency") or 1)
    batch = max(1, min(conc, k.max_running or conc))
    if trial.get("decode_tok_s"):
        context = float(trial.get("context_len") or (trial.get("prompt_tokens") or 512))
        return [(1.0, p) for p in decode_step(model, k, profile, 1, context, draft)], per_step, "decode_tok_s"
    prompt, out, n = int(trial["prompt_tokens"]), float(trial["output_tokens"]), int(trial["num_requests"])
    waves = math.ceil(n / batch)
    steps = out / per_step
    passes = [(waves * batch, p) for p in prefill_passes(model, k, profile, prompt)]
    passes += [(waves * steps, p) for p in decode_step(model, k, profile, batch, prompt + out / 2, draft)]
    return passes, n * out, "output_tok_s"


def _arrays(items):
    """Per-pass arrays (count, mem, compute, comm + fixed, steps, kernels, eager kernels, speculative steps) and the
    trial each belongs to."""
    rows = [(i, c, p.mem_s, p.compute_s, p.comm_s + p.fixed_s, p.steps, p.kernels, p.kernels if p.eager else 0, p.spec_steps)
            for i, (passes, _, _) in enumerate(items) for c, p in _merged(passes)]
    a = np.array(rows, dtype=float)
    return a[:, 0].astype(int), a[:, 1:]


def _merged(passes):
    """Identical passes of one trial as one (count summed): fewer columns for the grid."""
    out: dict = {}
    for count, p in passes:
        out[p] = out.get(p, 0.0) + count
    return [(c, p) for p, c in out.items()]


def _predicted_seconds(theta: np.ndarray, owner: np.ndarray, cols: np.ndarray, n: int) -> np.ndarray:
    """theta (G, 6) -> seconds (G, n) per trial (Pass.seconds, vectorised)."""
    count, mem, comp, comm, steps, kernels, eager, spec = cols.T
    ms, cs, so, ks, ls, ss = (theta[:, i:i + 1] for i in range(len(NAMES)))
    per_pass = count * (np.maximum(np.maximum(ms * mem, cs * comp), ks * kernels) + comm + so * steps + ls * eager
                        + ss * spec)
    out = np.zeros((theta.shape[0], n))
    for j in range(n):
        out[:, j] = per_pass[:, owner == j].sum(axis=1)
    return out


@dataclass
class Calibration:
    coefficients: Coefficients
    alphas: dict[str, float] = field(default_factory=dict)  # measured first-position acceptance per drafter family
    trials: int = 0
    error_before: float | None = None  # median |predicted/measured - 1| of the priors on the trials, in %
    error_after: float | None = None

    @classmethod
    def fit(cls, trials: list[dict], model: ModelSpec, profile, num_gpus: int = 1, *, engine: Engine,
            draft: ModelSpec | None = None) -> Calibration:
        """Fit to `trials` (configs of the engine adapter `engine`) measured on `profile`."""
        trials = [t for t in trials if t.get("decode_tok_s") or t.get("output_tok_s")]
        if not trials:
            raise ValueError("calibration needs at least one trial with a measured decode_tok_s or output_tok_s")
        on_gpu = bool(profile is not None and profile.is_gpu)
        by_drafter: dict[str, list[float]] = {}
        for t in trials:
            k = engine.knobs(t["config"], on_gpu)
            if k.drafter and t.get("accept_length"):
                shape = drafter_acceptance(k.drafter, model.mtp_layers)
                by_drafter.setdefault(k.drafter, []).append(scaled_to(float(t["accept_length"]), k, shape).alpha_1)
        alphas = {d: float(np.median(v)) for d, v in by_drafter.items()}
        prior = default_coefficients(profile, engine)
        items = [trial_passes(t, model, profile, engine, alphas, draft) for t in trials]
        owner, cols = _arrays(items)
        tokens = np.array([tok for _, tok, _ in items])
        measured = np.array([tokens[i] / float(t[items[i][2]]) for i, t in enumerate(trials)])  # seconds
        p0 = np.array([getattr(prior, n) for n in NAMES])

        def loss(theta):
            pred = _predicted_seconds(theta, owner, cols, len(trials))
            fit = ((np.log(pred) - np.log(measured)) ** 2).sum(axis=1)
            return fit + RIDGE * ((np.log(theta) - np.log(p0)) ** 2).sum(axis=1)

        best, span = p0, 3.0  # search best * 10^[-span, span] per coefficient, then narrow around the winner
        for _ in range(4):
            axes = [b * np.logspace(-span, span, GRID_POINTS) for b in best]
            grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, len(NAMES))
            best = grid[np.argmin(loss(grid))]
            span /= 4
        coef = Coefficients(*map(float, best))
        before = _predicted_seconds(p0[None], owner, cols, len(trials))[0]
        after = _predicted_seconds(best[None], owner, cols, len(trials))[0]
        pct = lambda pred: float(np.median(np.abs(measured / pred - 1)) * 100)
        return cls(coef, alphas, len(trials), pct(before), pct(after))

    def to_dict(self) -> dict:
        return {"coefficients": {n: getattr(self.coefficients, n) for n in NAMES}, "alphas": self.alphas,
                "trials": self.trials, "error_before_pct": self.error_before, "error_after_pct": self.error_after}


def predict_trial(trial: dict, model: ModelSpec, profile, *, engine: Engine,
                  calibration: Calibration | None = None, draft: ModelSpec | None = None) -> float:
    """Predicted tok/s in the unit the trial measured (decode_tok_s if present, else output_tok_s)."""
    coef = calibration.coefficients if calibration else default_coefficients(profile, engine)
    passes, tokens, _ = trial_passes(trial, model, profile, engine, calibration.alphas if calibration else {}, draft)
    return tokens / sum(c * p.seconds(coef) for c, p in passes)


GRID_DEFAULTS = {"prefill_ubatch": 256, "early_exit_layers": 8, "dtype": "float32"}  # the grid header's fixed settings


def grid_trials(path, *, concurrency: int, num_requests: int, output_tokens: int, prompt_tokens: int) -> list[dict]:
    """Trials from a recorded grid CSV (benchmarks/bench_sample_efficiency.py --measure): one per
    measured cell, its swept settings over the grid's fixed ones, at the load it was measured with."""
    text = Path(path).read_text().splitlines()
    trials = []
    for r in csv.DictReader(line for line in text if not line.startswith("#")):
        if r["error"] or not r["output_tok_s"]:
            continue
        swept = {k: (v if k in ("drafter", "dtype") else int(v)) for k, v in r.items()
                 if k in ("drafter", "draft_length", "dtype", "threads", "verify_slots", "prefill_ubatch") and v}
        trials.append({"config": {**GRID_DEFAULTS, **swept}, "concurrency": concurrency, "num_requests": num_requests,
                       "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
                       "output_tok_s": float(r["output_tok_s"]),
                       "accept_length": float(r["accept_length"]) if r["accept_length"] else None})
    return trials
