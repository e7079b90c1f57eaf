"""Search spaces: load, narrow, sample; hardware conditions."""
from autotune.space.space import (
    Param,
    Space,
    SpaceError,
    load_overrides,
    load_space,
    parse_set_options,
    parse_space,
)

__all__ = ["Param", "Space", "SpaceError", "load_overrides", "load_space", "parse_set_options", "parse_space"]
