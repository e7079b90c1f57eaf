"""How validation proves a winner: the one record of its defaults, read by `autotune validate`, `run`'s finish
(with the engine's own lighter round, its facts' `finish_validation`) and `autotune ci`'s re-tune (with the
settings the study was validated under)."""
from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ValidationSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    top: int = Field(3, ge=1)  # the study's best distinct configurations relaunched
    repeats: int = Field(3, ge=1)  # benchmarks of each on fresh launches, the first round
    max_repeats: int = Field(6, ge=1)  # where adding repeats to a close race stops (at least `repeats`)
    max_noise: float = Field(0.10, gt=0)  # relative MAD of the objective above which a configuration is "noisy"
    confidence: float = Field(0.90, gt=0, lt=1)  # a winner's gain over a rival must clear 1.0 at it, else they tie
    quality_prompts: int = Field(4, ge=0)  # greedy prompts compared with the baseline's output
    quality_tokens: int = Field(32, ge=1)  # tokens generated per greedy prompt

    def updated(self, overrides: Mapping) -> ValidationSettings:
        """These settings with `overrides`' known keys set (None: unset); ValueError naming a bad value."""
        given = {k: v for k, v in overrides.items() if k in type(self).model_fields and v is not None}
        try:
            return type(self).model_validate({**self.model_dump(), **given})
        except ValidationError as e:
            err = e.errors()[0]
            flag = "--" + str(err["loc"][0]).replace("_", "-")
            raise ValueError(f"{flag} {err['input']!r}: {err['msg'][0].lower()}{err['msg'][1:]}") from None

    @property
    def repeat_cap(self) -> int:
        return max(self.repeats, self.max_repeats)
