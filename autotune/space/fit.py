"""A space fitted to the machine and the load, from hardware facts only (never from a measured grid):
which device the engine runs on, which reduced-precision units the hardware has, and the study's
concurrency (see `Space.fitted` for what the space's YAML says about each)."""
from __future__ import annotations

from autotune.space.space import Space

# CPU ISA flags (as /proc/cpuinfo names them) that execute a type natively: AVX512-BF16 / AMX-BF16 for
# bfloat16, AVX512-FP16 / AMX-FP16 for float16 (Intel's ISA reference,
# https://www.intel.com/content/www/us/en/developer/articles/technical/intel-sdm.html). Without them
# torch converts to float32 around every op.
CPU_UNITS = {"bf16": {"avx512_bf16", "amx_bf16"}, "fp16": {"avx512_fp16", "amx_fp16"}}


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
    flags = set(getattr(getattr(hw, "cpu", None), "isa_flags", None) or [])
    return {unit for unit, isa in CPU_UNITS.items() if flags & isa}


def fit_space(space: Space, hw, concurrency: int | None) -> Space:
    """`space` for this machine under `concurrency` requests at a time (1 when not given)."""
    return space.fitted(device(hw), max(1, concurrency or 1), native_units(hw))
