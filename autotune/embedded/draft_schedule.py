"""A draft-length schedule: the batch size of a step -> the draft length it proposes (0 = no speculation).

Load changes what speculation is worth: a verify step of B streams costs more as B grows, while what each
stream accepts does not, so the draft length that wins single-stream loses under load (vLLM #27379 and
#49369, SGLang #1979 and #6949). A schedule is fitted from measurements at several batch sizes
(study/schedule.py) and each engine runs it in its own terms: the embedded engine at every step
(`autotune serve --draft-schedule FILE`), vLLM as `num_speculative_tokens_per_batch_size`; the export says
what an engine cannot express.

File (YAML or JSON): rows in increasing `max_batch`; a step of batch B uses the first row with
B <= max_batch, and the last row every larger batch too. The per-request cap and the entropy stop of
draft_policy.py still apply within the length a row allows; a step the schedule leaves no draft to is a plain
step, stop rule and all (scheduler.Engine._decode).

    drafter: ngram
    rows:
      - {max_batch: 1, draft_length: 8}
      - {max_batch: 4, draft_length: 4}
      - {max_batch: 8, draft_length: 0}
"""
from __future__ import annotations

import bisect
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ScheduleRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_batch: int = Field(ge=1)
    draft_length: int = Field(ge=0)


class DraftSchedule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    drafter: str
    rows: tuple[ScheduleRow, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _increasing(self) -> DraftSchedule:
        bounds = [r.max_batch for r in self.rows]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"rows must be in strictly increasing max_batch, got {bounds}")
        return self

    def length_for(self, batch: int) -> int:
        """The draft length of a step of `batch` sequences."""
        i = bisect.bisect_left(self._bounds, batch)
        return self.rows[min(i, len(self.rows) - 1)].draft_length

    @property
    def _bounds(self) -> list[int]:
        return [r.max_batch for r in self.rows]

    @property
    def max_draft_length(self) -> int:
        return max(r.draft_length for r in self.rows)

    @classmethod
    def load(cls, path: str | Path) -> DraftSchedule:
        """Read a schedule file; a missing or malformed one is a one-line ValueError naming the file."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())  # JSON is YAML
            return cls.model_validate(data)
        except OSError as e:
            raise ValueError(f"draft schedule {path}: {e.strerror or e}") from None
        except (yaml.YAMLError, ValidationError, ValueError) as e:
            first = e.errors()[0] if isinstance(e, ValidationError) else None
            where = ".".join(str(x) for x in first["loc"]) + ": " if first and first["loc"] else ""
            why = first["msg"] if first else str(e).splitlines()[0]
            raise ValueError(f"draft schedule {path}: {where}{why}") from None

    def dump(self, path: str | Path) -> Path:
        path = Path(path)
        text = (json.dumps(self.model_dump(mode="json"), indent=1) + "\n" if path.suffix == ".json"
                else yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
        path.write_text(text)
        return path
