"""Hardware profiles: one YAML file per kind in `hardware_profiles/`; a user adds a kind by adding a file."""

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from autotune import shipped_folder

PROFILES_DIR = shipped_folder("hardware_profiles")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
FP8_MODES = ("native", "marlin_w8a16", "none")
FORM_FACTORS = ("sxm", "nvl", "pcie", "cpu")
# How GPUs of one box talk: a profile whose NVLink is a bridge (via: bridge) assumes the bridge is fitted;
# `--gpu NAME:pcie` plans for the same cards without it (PCIe-only workstations are common), `NAME:nvlink`
# insists on NVLink.
INTERCONNECTS = ("nvlink", "pcie")


@dataclass
class Profile:
    name: str  # the file name without .yaml: what `--gpu` takes
    description: str
    source_url: str  # the public spec sheet the numbers come from
    form_factor: str  # sxm | nvl (PCIe card with NVLink bridges) | pcie | cpu
    compute_capability: str | None
    architecture: str | None
    sm_count: int | None
    memory_gb: float | None
    memory_bandwidth_gbps: float | None
    peak_tflops: dict[str, float | None]  # dense; a dtype absent = no such units; null = runs, peak unknown
    fp8_mode: str  # native (cc >= 8.9) | marlin_w8a16 (Ampere: FP8 weights, 16-bit compute) | none
    interconnect: dict  # {"nvlink": {generation, bandwidth_gbps, via: sxm|bridge} | None, "pcie": {..}|None}
    power_limit_w: float | None
    # name_patterns (regexes), memory_gib [lo, hi], power_limit_w [lo, hi]; None: never matched automatically
    match: dict | None
    also_see: str | None = None
    # per-kernel cost in microseconds: {graph: a small kernel's floor inside a CUDA graph, eager: its
    # launch from eager PyTorch} (the speed model's priors: autotune/predict/speed.py); None: CPU
    kernel_us: dict | None = None

    @property
    def is_gpu(self) -> bool:
        return self.form_factor != "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def _load(path: Path) -> Profile:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a hardware profile must be a YAML mapping")  # noqa: TRY004 - bad input, one-line error
    try:
        profile = Profile(name=path.stem.lower(), **data)
    except TypeError as e:  # missing or unknown field
        raise ValueError(f"{path}: {e}".replace("Profile.__init__() ", "")) from None
    problems = []
    if profile.form_factor not in FORM_FACTORS:
        problems.append(f"form_factor must be one of {', '.join(FORM_FACTORS)}")
    if profile.fp8_mode not in FP8_MODES:
        problems.append(f"fp8_mode must be one of {', '.join(FP8_MODES)}")
    if unknown := set(profile.peak_tflops) - set(DTYPES):
        problems.append(f"peak_tflops has unknown dtypes {sorted(unknown)}")
    if profile.fp8_mode == "native" and "fp8" not in profile.peak_tflops:
        problems.append("fp8_mode native needs a peak_tflops.fp8 entry")
    if profile.match is not None:
        if not profile.match.get("name_patterns"):
            problems.append("match needs name_patterns")
        for key in ("memory_gib", "power_limit_w"):
            bounds = profile.match.get(key)
            if bounds is not None and not (isinstance(bounds, list) and len(bounds) == 2
                                           and all(isinstance(b, (int, float)) for b in bounds)):
                problems.append(f"match.{key} must be [low, high]")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return profile


def load_profiles(extra_dir: str | Path | None = None) -> dict[str, Profile]:
    """All profiles by name: the shipped ones, then `extra_dir`'s (a same-named file there wins)."""
    dirs = [PROFILES_DIR] + ([Path(extra_dir)] if extra_dir else [])
    return {p.stem.lower(): _load(p) for d in dirs for p in sorted(Path(d).glob("*.yaml"))}


def with_interconnect(profile: Profile, link: str) -> Profile:
    """`profile` on a box whose GPUs talk over `link` only: "pcie" drops NVLink (bridged cards without
    their bridge), "nvlink" keeps the profile as it is where it has NVLink."""
    if link not in INTERCONNECTS:
        raise ValueError(f"interconnect {link!r} is not one of {', '.join(INTERCONNECTS)}")
    if not profile.interconnect.get(link):
        raise ValueError(f"hardware profile {profile.name} has no {link} interconnect")
    kept = profile.interconnect if link == "nvlink" else {**profile.interconnect, "nvlink": None}
    return replace(profile, name=f"{profile.name}:{link}", interconnect=kept)


def get_profile(name: str, profiles: dict[str, Profile] | None = None) -> Profile:
    """A profile by name; NAME:pcie / NAME:nvlink is that profile over that interconnect only."""
    profiles = profiles if profiles is not None else load_profiles()
    key, _, link = name.strip().lower().partition(":")
    if key not in profiles:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(profiles))} "
                         f"(each as NAME:{' or NAME:'.join(INTERCONNECTS)} for one interconnect)")
    return with_interconnect(profiles[key], link) if link else profiles[key]
