"""Hardware probing: measure the machine (NVML, nvidia-smi, torch, /proc) and match it to a profile."""

from autotune.hardware.facts import CpuInfo, GpuInfo, Hardware
from autotune.hardware.probe import classify_from_fixture, planned, probe, probe_from_evidence
from autotune.hardware.profiles import Profile, get_profile, load_profiles

__all__ = [
    "CpuInfo",
    "GpuInfo",
    "Hardware",
    "Profile",
    "classify_from_fixture",
    "get_profile",
    "load_profiles",
    "planned",
    "probe",
    "probe_from_evidence",
]
