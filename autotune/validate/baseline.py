"""The baseline every gain is measured against: the engine defaults with the user's pins, speculation off."""
from __future__ import annotations

from autotune.study.record import effective_key
from autotune.study.storage import StudyContext


def baseline_config(ctx: StudyContext) -> tuple[dict, int | None]:
    """The engine defaults with the user's pins: the study's defaults seed (narrowed by --set; where the
    narrowing left it out, the first seed run) with speculation off, so its greedy output is plain greedy
    decoding. Also the trial that measured exactly it, if any."""
    seeds = [t for t in ctx.study.get_trials(deepcopy=False) if t.user_attrs.get("seed_config") is not None]
    seeds = sorted(seeds, key=lambda t: not t.user_attrs.get("defaults_seed"))  # stable: else the first seed
    seed = ctx.study.user_attrs.get("defaults_seed_config") or (seeds[0].user_attrs["seed_config"] if seeds else {})
    config = {**seed, **ctx.adapter.facts.speculation_off}
    key = effective_key(ctx.adapter, config)
    same = [t for t in ctx.study.get_trials(deepcopy=False) if t.user_attrs.get("effective_key") == key]
    return config, (same[0].number if same else None)
