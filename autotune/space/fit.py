"""A space fitted to the machine and the load, from hardware facts only (never from a measured grid):
which device the engine runs on, which reduced-precision units the hardware has, and the study's
concurrency (see `Space.fitted` for what the space's YAML says about each)."""
from __future__ import annotations

from autotune.space.space import Space


def device(hw) -> str:
    """Where the engine runs: "cuda" on a machine with an NVIDIA GPU, else "cpu"."""
    return "cuda" if int(getattr(hw, "gpu_count", 0) or 0) else "cpu"


def native_units(hw) -> set[str] | None:
    """The number formats the hardware computes in natively ("bf16", "fp16", ...); None where no fact
    says (a GPU without a profile)."""
    if device(hw) == "cuda":
        profile = getattr(hw, "profile", None)
        if profile is None or not profile.peak_tflops:
            return None
        return {unit for unit, peak in profile.peak_tflops.items() if peak}  # the sheet lists a Tensor Core peak
    cpu = getattr(hw, "cpu", None)
    return cpu.native_units() if cpu is not None else set()


def fit_space(space: Space, hw, concurrency: int | None) -> Space:
    """`space` for this machine under `concurrency` requests at a time (1 when not given)."""
    return space.fitted(device(hw), max(1, concurrency or 1), native_units(hw))
