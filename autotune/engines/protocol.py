"""The behaviour every engine provides itself: launching a configuration, its rules, what it would really run,
readiness, runtime changes and the draft-length schedule. What an engine is as data lives in its EngineFacts
(autotune/engines/facts.py); what all engines do alike lives in EngineAdapter (autotune/engines/base.py), whose
subclasses are checked against this protocol by tests/engines/test_engines.py."""
from pathlib import Path
from typing import Protocol, runtime_checkable

from autotune.embedded.draft_schedule import DraftSchedule
from autotune.engines.base import ScheduleRendering
from autotune.engines.facts import EngineFacts
from autotune.predict.knobs import Knobs


@runtime_checkable
class EngineBehaviour(Protocol):
    name: str
    facts: EngineFacts

    def command(self, config: dict, *, model: str | None, draft_model: str | None, host: str, port: int,
                extra_args: list[str] = ()) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that launch `config` as an OpenAI-compatible server."""

    def check(self, config: dict, hardware=None, *, has_draft_model: bool | None = None) -> list[str]:
        """The engine's cross-flag rules: one line per violation (none: it would start)."""

    def effective(self, config: dict) -> dict:
        """The settings the engine would actually run (defaults and inert settings dropped): equal ones are one
        trial."""

    def knobs(self, config: dict, on_gpu: bool = True) -> Knobs:
        """`config` read from the engine's own option names into the memory and speed model's engine-neutral
        record."""

    def health_url(self, base_url: str) -> str:
        """Readiness: the URL that answers 200 once the server serves."""

    def apply_runtime(self, base_url: str, runtime: dict) -> None:
        """Change `runtime` (facts.runtime_params) on a running server; ValueError where it refuses."""

    def draft_length(self, config: dict) -> int:
        """Tokens a request drafts per step under `config` (0: it does not draft)."""

    def with_draft_length(self, config: dict, k: int) -> dict:
        """`config` drafting `k` tokens per step, its drafter kept."""

    def schedule_args(self, config: dict, schedule: DraftSchedule, *,
                      directory: str | Path = ".") -> ScheduleRendering:
        """`schedule` (batch size -> draft length, fitted for `config`'s drafter) in the engine's own terms; a
        file it needs is named under `directory` (where the export writes launch.sh). ValueError (one line) where
        `config` does not draft."""
