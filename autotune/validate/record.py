"""What validation writes to best/validation.json, as typed records, and the one way to read it back.

The file keeps the keys it always had: a configuration's `reasons` are their texts, and `reason_kinds`
(beside them, added with kinds) what decisions read. A file written before kinds existed still loads:
its reasons are of kind `unknown` (nothing decides on a loaded file's reasons).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, computed_field, field_serializer, model_validator

from autotune.engines import get_adapter

ReasonKind = Literal[
    "launch_failed",  # the server did not start
    "server_exited",  # the server died during a repeat
    "request_errors",  # a repeat had failed requests
    "slo",  # a repeat missed an SLO
    "noisy",  # the objective's MAD above max_noise of its median: widens the interval, does not demote
    "quality",  # the greedy requests failed
    "regressed",  # ci: slower than the recorded numbers beyond the tolerance
    "no_reference",  # ci: nothing recorded to compare with
    "unknown",  # read from a file written before reasons had kinds
]


class Reason(BaseModel):
    """Why a configuration cannot win (or a re-check failed): `kind` for decisions, `text` for people."""
    model_config = ConfigDict(frozen=True)
    kind: ReasonKind
    text: str


class WithReasons(BaseModel):
    """A record with `reasons: list[Reason]` (declared where its key sits in the file), written as texts plus
    their kinds (`reason_kinds`)."""

    @model_validator(mode="before")
    @classmethod
    def _reasons_from_file(cls, data):
        if isinstance(data, dict) and any(isinstance(r, str) for r in data.get("reasons") or []):
            kinds = data.get("reason_kinds") or ["unknown"] * len(data["reasons"])
            data = {**data, "reasons": [{"kind": k, "text": t} for k, t in zip(kinds, data["reasons"])]}
        return data

    @field_serializer("reasons", check_fields=False)
    def _reason_texts(self, reasons: list[Reason]) -> list[str]:
        return [r.text for r in reasons]

    @computed_field
    @property
    def reason_kinds(self) -> list[str]:
        return [r.kind for r in self.reasons]  # type: ignore[attr-defined]


class Spread(BaseModel):
    """One metric over the repeats (statistics.spread): median, MAD, relative MAD, bootstrap 95% interval."""
    median: float | None
    mad: float | None
    rel_mad: float | None
    ci95: list[float] | None
    values: list[float]


class ValidatedConfig(WithReasons):
    """One configuration's validation: its launch, its repeats, its greedy-output verdict and its status."""
    label: str
    trial: int | None = None
    config: dict
    argv: list | None = None
    env: dict | None = None
    log: str | None = None
    launch_s: float | None = None
    warmup_s: float | None = None
    bench_requests: int | None = None
    failure: str | None = None  # why it has no (more) measurements: a failed launch, a server that exited
    greedy_error: str | None = None
    study_value: float | None = None
    stats: dict[str, Spread] = {}
    quality: dict | None = None  # quality.quality()'s verdict: mode, identical prompts, token agreement, ...
    status: Literal["passed", "demoted"] | None = None
    reasons: list[Reason] = []
    request_files: list[str] = []
    runs: list[dict] = []  # each repeat's headline numbers (the registry's HEADLINE, completed, failed, ...)


class Demoted(WithReasons):
    trial: int | None
    reasons: list[Reason]


class Comparison(BaseModel):
    """The winner against one rival: the gain with its interval (statistics.gain_interval), if both have 2 runs."""
    winner: str
    rival: str
    rival_trial: int | None
    gain: float | None
    interval: list[float] | None
    confidence: float | None = None
    looks: int | None = None
    repeats: list[int]
    beyond_noise: bool


class Tie(BaseModel):
    between: list[str]
    trials: list[int | None]
    fastest: str
    exported: str
    changed: dict[str, list[str]]
    race_cut: bool = False  # files before --budget have none
    why: str


class Winner(BaseModel):
    trial: int | None
    label: str | None = None  # files before ties have no label, repeats or tie
    config: dict
    argv: list
    env: dict
    median: float
    gain_over_baseline: float | None = None
    repeats: int | None = None
    stats: dict[str, Spread]
    tie: bool = False
    warning: str | None = None


class Validation(BaseModel):
    """best/validation.json."""
    study: str
    storage: str
    engine: str
    objective: str
    metric: str
    direction: Literal["maximize", "minimize"]
    written: str
    settings: dict  # the run's settings and the load it measured (concurrency, num_requests, ...)
    baseline: ValidatedConfig
    candidates: list[ValidatedConfig]
    demoted: list[Demoted]
    comparisons: list[Comparison] = []  # files before ties have neither
    tie: Tie | None = None
    winner: Winner | None

    @classmethod
    def load(cls, path: Path) -> Validation | None:
        """The validation at `path` (a file, or a study's best/ folder); None where there is none."""
        path = path / "validation.json" if path.is_dir() else path
        return cls.model_validate_json(path.read_text()) if path.exists() else None

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.dump(), indent=2, default=str) + "\n")
        return path

    def dump(self) -> dict:
        """As the file holds it: the keys each record was given (a failed launch has no stats)."""
        return self.model_dump(exclude_unset=True)

    def candidate(self, trial: int | None) -> ValidatedConfig | None:
        return next((c for c in self.candidates if c.trial == trial), None)

    def winner_changes(self) -> list[str]:
        """The winner's settings that make the engine run otherwise than the baseline (the engine defaults with the
        user's pins) as key=value; empty when the engine runs the baseline's configuration (its gain over it is
        then noise). Compared as the engine runs them: SGLang's "none" and an unset flag are one setting."""
        if self.winner is None:
            return []
        adapter = get_adapter(self.engine)
        config = self.winner.config
        mine, base = adapter.effective(config), adapter.effective(self.baseline.config)
        keys = [*config, *sorted(set(base) - set(config))]
        return [f"{k}={config.get(k)}" for k in keys if mine.get(k) != base.get(k)]
