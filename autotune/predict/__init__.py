"""Predict before you launch: memory per GPU and decode speed of a configuration, ranked.

    engine = get_adapter("sglang")                # the engine's adapter (autotune.engines): its knobs()
    model = load_model("llama-3.1-8b")            # a preset, an HF directory or a .gguf file
    memory = predict_memory(model, config, profile, num_gpus, engine=engine)   # fits? KV tokens left
    speed = predict_speed(model, config, profile, num_gpus, engine=engine, concurrency=8)
    best = rank_configs(load_space("sglang"), model, profile, num_gpus, top=5, engine=engine)
    calibration = Calibration.fit(trials, model, profile, engine=engine)        # from measured trials
    drafter_acceptance("mtp", model.mtp_layers)   # per-position acceptance, fitted to published accept lengths

This package never imports the engines: the caller passes the adapter (what it reads: knobs.Engine).
"""
from autotune.predict.acceptance import (
    ALPHA_PRIORS,
    Acceptance,
    drafter_acceptance,
    expected_tokens,
    published,
)
from autotune.predict.calibration import Calibration, predict_trial, trial_from_metrics
from autotune.predict.drafts import DraftCheckpoint, draft_kind, read_draft
from autotune.predict.memory import MemoryEstimate, estimate_memory, predict_memory
from autotune.predict.models import ModelSpec, load_model, presets
from autotune.predict.rank import Prediction, launch_command, rank_configs
from autotune.predict.speed import Coefficients, SpeedEstimate, predict_speed

__all__ = ["ALPHA_PRIORS", "Acceptance", "Calibration", "Coefficients", "DraftCheckpoint", "MemoryEstimate", "ModelSpec", "Prediction", "SpeedEstimate",
           "draft_kind", "drafter_acceptance", "estimate_memory", "expected_tokens", "launch_command", "load_model", "predict_memory", "predict_speed",
           "predict_trial", "presets", "published", "rank_configs", "read_draft", "trial_from_metrics"]
