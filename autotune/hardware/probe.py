"""`probe()`: what this machine (or a planned one) is, as a `Hardware` with the evidence for every fact."""

import json
import re
from pathlib import Path

from autotune.hardware.classify import cpu_facts, gpu_facts, match_profile, nvml_topology
from autotune.hardware.facts import GpuInfo, Hardware
from autotune.hardware.gather import VERSIONED_PACKAGES, gather
from autotune.hardware.parse import parse_smi_q, parse_topo
from autotune.hardware.profiles import Profile, get_profile, load_profiles


def probe(gpu: str = "auto", profiles_dir: str | Path | None = None) -> Hardware:
    """`gpu`: "auto" measures this machine; "cpu" skips its GPUs; a profile name plans for that machine.

    Raises ValueError (one line, listing the known names) for an unknown profile; never for NVML trouble.
    """
    profiles = load_profiles(profiles_dir)
    if gpu.strip().lower() == "auto":
        return probe_from_evidence(gather(), profiles=profiles, source="measured")
    profile = get_profile(gpu, profiles)
    if not profile.is_gpu:
        hardware = probe_from_evidence(gather(gpus=False), profiles=profiles, source="measured")
        hardware.notes.append("GPUs not probed: --gpu cpu asks for the CPU profile")
        return hardware
    return planned(profile)


def planned(profile: Profile) -> Hardware:
    """A machine we do not have, described by its profile alone (for estimates)."""
    why = f"profile {profile.name}"
    gpu = GpuInfo(index=0, name=profile.description, memory_gb=profile.memory_gb,
                  compute_capability=profile.compute_capability, architecture=profile.architecture,
                  sm_count=profile.sm_count,
                  pcie_gen=(profile.interconnect.get("pcie") or {}).get("generation"),
                  power_limit_w=profile.power_limit_w, power_default_w=profile.power_limit_w,
                  power_max_w=profile.power_limit_w, form_factor=profile.form_factor)
    gpu.evidence = {fact: why for fact, value in vars(gpu).items()
                    if value is not None and fact not in ("index", "evidence")}
    return Hardware(gpus=[gpu], topology=None, driver_version=None, cuda_driver_version=None,
                    nvml_version=None, versions={}, cpu=None, profile=profile,
                    source=f"planned from profile {profile.name}",
                    notes=[f"planned machine: nothing measured; GPU facts from {why} ({profile.source_url})"])


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def probe_from_evidence(
    evidence: dict,
    smi_q: str | None = None,
    topo: str | None = None,
    profiles: dict[str, Profile] | None = None,
    source: str = "evidence",
) -> Hardware:
    """Classifies raw evidence: a gathered dict (gather.py; a fixture's probe.json) plus nvidia-smi texts."""
    profiles = profiles if profiles is not None else load_profiles()
    smi_q = smi_q or _text(evidence.get("nvidia_smi_q"))
    topo = topo or _text(evidence.get("nvidia_smi_topo"))
    smi_header, smi_gpus = parse_smi_q(smi_q) if smi_q else ({}, [])
    nvml_devices = [d for d in evidence.get("devices") or [] if isinstance(d, dict)]
    # Older captures hold one device's properties as "torch_props".
    torch_devices = evidence.get("torch_devices") or [evidence[k] for k in ("torch_props",) if k in evidence]
    sources = {"nvml_error": "NVML", "nvidia_smi_error": "nvidia-smi", "torch_error": "torch"}
    notes = [f"{name}: {evidence[key]}" for key, name in sources.items() if evidence.get(key)]
    smi_answers = evidence.get("nvidia_smi_q"), evidence.get("nvidia_smi_topo")
    notes += [f"nvidia-smi failed: {v['error']}" for v in smi_answers if isinstance(v, dict) and "error" in v]

    count = max(len(nvml_devices), len(smi_gpus), len(torch_devices))
    gpus = [gpu_facts(i, _nth(nvml_devices, i), _nth(smi_gpus, i), _nth(torch_devices, i))
            for i in range(count)]

    warnings, profile = [], None
    if gpus:
        matches = [match_profile(g, profiles) for g in gpus]
        profile, why = matches[0]
        notes.append(why)
        if any(p is not profile for p, _ in matches):
            names = ", ".join(sorted({str(g.name) for g in gpus}))
            used = profile.name if profile else "none"
            warnings.append(f"the GPUs differ: {names}; GPU0's profile used ({used})")
        for g in gpus:
            _fill_from_profile(g, profile)
            warnings += _gpu_warnings(g)
    else:
        profile = next((p for p in profiles.values() if not p.is_gpu), None)
        notes.append("no NVIDIA GPU found: CPU profile")

    cpu = cpu_facts(evidence)
    if cpu.thp_mode == "always":
        warnings.append(
            "transparent huge pages = always: a known cause of stalls with pinned memory "
            "(set /sys/kernel/mm/transparent_hugepage/enabled to madvise)"
        )
    topology = parse_topo(topo) if topo else None
    if topology is None and len(nvml_devices) > 1:
        topology = nvml_topology(nvml_devices, evidence.get("nvml_common_ancestor") or [])
    cuda = evidence.get("cuda_driver_version")  # NVML's 13000 means 13.0
    cuda = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else smi_header.get("CUDA Version")
    versions = _versions(evidence)
    if isinstance(evidence.get("llama_server"), dict):
        versions["llamacpp"], note = llama_server_facts(evidence["llama_server"])
        notes.append(note)
    for engine, found in (evidence.get("python_engines") or {}).items():  # in an environment of its own
        versions[engine] = found["version"]
        notes.append(f"{engine}: {found['distribution']} {found['version']} in {found['python']}")
    return Hardware(gpus=gpus, topology=topology if len(gpus) > 1 else None,
                    driver_version=_text(evidence.get("driver")) or smi_header.get("Driver Version"),
                    cuda_driver_version=cuda, nvml_version=_text(evidence.get("nvml_version")),
                    versions=versions, cpu=cpu, profile=profile, source=source,
                    warnings=warnings, notes=notes)


def llama_server_facts(server: dict) -> tuple[str | None, str]:
    """(build number, one line: version, path, backends, devices) from gather_llama_server's texts. The CPU
    backend is always there; --list-devices names the others' devices ("CUDA0: NVIDIA H200 (143166 MiB, ...)")."""
    version = re.search(r"version: (\S+) \(build (\d+)", _text(server.get("version")) or "")
    devices = re.findall(r"^\s+(\w+?)\d*: (.+?) \((\d+) MiB", _text(server.get("devices")) or "", re.MULTILINE)
    backends = ["CPU", *dict.fromkeys(backend for backend, _, _ in devices)]
    listed = ", ".join(f"{name} {round(int(mib) / 1024, 1)} GiB" for _, name, mib in devices) or "none beside the CPU"
    if version is None:
        return None, f"llama-server {server.get('path')}: `--version` said no build number ({server.get('version')})"
    return version.group(2), (f"llama-server {version.group(1)} (build {version.group(2)}) at {server.get('path')}: "
                              f"backends {', '.join(backends)}; devices: {listed}")


def _nth(items: list[dict], i: int) -> dict:
    return items[i] if i < len(items) else {}


def _versions(evidence: dict) -> dict[str, str | None]:
    versions = {k: v for k, v in (evidence.get("versions") or {}).items() if k in VERSIONED_PACKAGES}
    versions.setdefault("torch", _text(evidence.get("torch")))
    # Older captures wrote "absent: ModuleNotFoundError" for a missing package.
    return {k: None if v is None or v.startswith("absent") else v for k, v in versions.items()}


def _fill_from_profile(gpu: GpuInfo, profile: Profile | None) -> None:
    """Facts no source measured, taken from the matched profile (and said so)."""
    if profile is None:
        return
    for fact in ("compute_capability", "architecture", "sm_count"):
        if getattr(gpu, fact) is None and getattr(profile, fact) is not None:
            setattr(gpu, fact, getattr(profile, fact))
            gpu.evidence[fact] = f"not measured: profile {profile.name}"


def _gpu_warnings(gpu: GpuInfo) -> list[str]:
    warnings = []
    if gpu.mig_mode == "enabled":
        warnings.append(f"GPU{gpu.index} has MIG enabled: its memory and SMs are split between instances")
    if gpu.power_limit_w and gpu.power_default_w and gpu.power_limit_w < 0.95 * gpu.power_default_w:
        warnings.append(
            f"GPU{gpu.index} power limit {gpu.power_limit_w:g} W is below the board's default "
            f"{gpu.power_default_w:g} W: throughput will be lower than the profile's peaks"
        )
    return warnings


def classify_from_fixture(path: str | Path, profiles: dict[str, Profile] | None = None) -> Hardware:
    """A fixture folder: probe.json (gather()'s dict), nvidia-smi-q.txt, nvidia-smi-topo.txt; all optional."""
    path = Path(path)

    def read(name: str) -> str | None:
        return (path / name).read_text() if (path / name).exists() else None

    evidence = json.loads(read("probe.json") or "{}")
    return probe_from_evidence(evidence, read("nvidia-smi-q.txt"), read("nvidia-smi-topo.txt"),
                               profiles=profiles, source=f"fixture {path.name}")
