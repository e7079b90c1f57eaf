"""Raw evidence → facts: each GPU fact from the first source that has it, the form factor, the profile."""

import re

from autotune.hardware.facts import CpuInfo, GpuInfo
from autotune.hardware.parse import parse_cpu_text, smi_number, smi_value
from autotune.hardware.profiles import Profile

GIB = 2**30
# CUDA cores per SM, to turn NVML's core count into SMs when torch is not there to ask.
CORES_PER_SM = {"7.0": 64, "7.5": 64, "8.0": 64}  # every later architecture: 128
ARCHITECTURES = {"7.0": "Volta", "7.5": "Turing", "8.0": "Ampere", "8.6": "Ampere", "8.7": "Ampere",
                 "8.9": "Ada Lovelace", "9.0": "Hopper", "10.0": "Blackwell", "12.0": "Blackwell"}
# nvmlDeviceGetTopologyCommonAncestor levels, named as `nvidia-smi topo -m` names them.
NVML_TOPOLOGY_LABELS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NVLINK_REMOTE_SWITCH = 2
# The highest PCIe/NVL card limit (H200 NVL); SXM modules go beyond (H100/H200 SXM: 700 W).
PCIE_MAX_POWER_W = 600


def _ok(value) -> bool:
    return value is not None and not (isinstance(value, dict) and "error" in value)


def _pick(gpu: GpuInfo, fact: str, *candidates):
    """Sets `fact` from the first (value, evidence) candidate whose value is known."""
    for value, evidence in candidates:
        if value is not None:
            setattr(gpu, fact, value)
            gpu.evidence[fact] = evidence
            return


def _nvml(device: dict, call: str, transform=lambda v: v):
    value = device.get(call)
    return (transform(value), f"NVML {call}") if _ok(value) else (None, "")


def _watts(milliwatts: int) -> float:
    return milliwatts / 1000


def gpu_facts(index: int, nvml: dict, smi: dict, torch: dict) -> GpuInfo:
    """One GPU's facts from its NVML record, `nvidia-smi -q` block and torch properties (any may be {})."""
    gpu = GpuInfo(index=index)
    props = "torch.cuda.get_device_properties"
    power = "GPU Power Readings/", "Power Readings/"  # the section's name before driver 535
    mib = smi_number(smi, "FB Memory Usage/Total")
    torch_gib = round(int(torch["total_memory"]) / GIB, 1) if "total_memory" in torch else None
    torch_cc = f"{torch['major']}.{torch['minor']}" if "major" in torch else None
    _pick(gpu, "name", _nvml(nvml, "nvmlDeviceGetName"),
          (smi_value(smi, "Product Name"), "nvidia-smi -q Product Name"), (torch.get("name"), props))
    _pick(gpu, "memory_gb", _nvml(nvml, "nvmlDeviceGetMemoryInfo", lambda m: round(m["total"] / GIB, 1)),
          (round(mib / 1024, 1) if mib else None, "nvidia-smi -q FB Memory Usage/Total"),
          (torch_gib, f"{props} total_memory"))
    _pick(gpu, "compute_capability",
          _nvml(nvml, "nvmlDeviceGetCudaComputeCapability", lambda v: f"{v[0]}.{v[1]}"),
          (torch_cc, f"{props} major.minor"))
    _pick(gpu, "architecture", (smi_value(smi, "Product Architecture"), "nvidia-smi -q Product Architecture"),
          (ARCHITECTURES.get(gpu.compute_capability or ""), f"compute capability {gpu.compute_capability}"))
    cores, _ = _nvml(nvml, "nvmlDeviceGetNumGpuCores")
    per_sm = CORES_PER_SM.get(gpu.compute_capability or "", 128)
    _pick(gpu, "sm_count", (torch.get("multi_processor_count"), f"{props} multi_processor_count"),
          (cores // per_sm if cores and gpu.compute_capability else None,
           f"NVML nvmlDeviceGetNumGpuCores {cores} / {per_sm} cores per SM"))
    _pick(gpu, "pcie_gen", _nvml(nvml, "nvmlDeviceGetMaxPcieLinkGeneration"),
          (smi_number(smi, "PCI/GPU Link Info/PCIe Generation/Max"), "nvidia-smi -q PCIe Generation/Max"))
    _pick(gpu, "pcie_width", _nvml(nvml, "nvmlDeviceGetMaxPcieLinkWidth"),
          (smi_number(smi, "PCI/GPU Link Info/Link Width/Max"), "nvidia-smi -q Link Width/Max"))
    _pick(gpu, "nvlink_active_links", *_nvlink(nvml))
    _pick(gpu, "power_limit_w", _nvml(nvml, "nvmlDeviceGetEnforcedPowerLimit", _watts),
          _nvml(nvml, "nvmlDeviceGetPowerManagementLimit", _watts),
          (smi_number(smi, *(p + k for p in power for k in ("Current Power Limit", "Power Limit"))),
           "nvidia-smi -q Current Power Limit"))
    _pick(gpu, "power_default_w", _nvml(nvml, "nvmlDeviceGetPowerManagementDefaultLimit", _watts),
          (smi_number(smi, *(p + "Default Power Limit" for p in power)), "nvidia-smi -q Default Power Limit"))
    limits = _nvml(nvml, "nvmlDeviceGetPowerManagementLimitConstraints", lambda v: _watts(v[1]))
    _pick(gpu, "power_max_w", limits,
          (smi_number(smi, *(p + "Max Power Limit" for p in power)), "nvidia-smi -q Max Power Limit"),
          (gpu.power_default_w, "no board maximum reported: the default limit"),
          (gpu.power_limit_w, "no board maximum reported: the enforced limit"))
    _pick(gpu, "board_part_number", _nvml(nvml, "nvmlDeviceGetBoardPartNumber"),
          (smi_value(smi, "Board Part Number"), "nvidia-smi -q Board Part Number"))
    smi_mig = smi_value(smi, "MIG Mode/Current")
    _pick(gpu, "mig_mode", _nvml(nvml, "nvmlDeviceGetMigMode", lambda v: "enabled" if v[0] else "disabled"),
          (smi_mig.lower() if smi_mig else None, "nvidia-smi -q MIG Mode/Current"))
    _pick(gpu, "bus_id", _nvml(nvml, "nvmlDeviceGetPciInfo", lambda p: p.get("busId")),
          (smi.get("Bus Id"), "nvidia-smi -q GPU block"))
    for fact in ("sm_count", "pcie_gen", "pcie_width"):  # nvidia-smi text and torch give these as str/float
        if getattr(gpu, fact) is not None:
            setattr(gpu, fact, int(getattr(gpu, fact)))
    gpu.form_factor, gpu.evidence["form_factor"] = decide_form_factor(gpu)
    return gpu


def _nvlink(nvml: dict) -> list[tuple]:
    states = nvml.get("nvlink_states")
    if not states:
        return []
    answered = [s for s in states if isinstance(s, int)]
    if not answered:
        return [(0, f"NVML nvmlDeviceGetNvLinkState: no link of {len(states)} supported (or hidden by a VM)")]
    active = answered.count(1)
    return [(active, f"NVML nvmlDeviceGetNvLinkState: {active} of {len(states)} links active")]


def _nth(items: list | None, i: int):
    return items[i] if items and i < len(items) else None


def nvml_topology(devices: list[dict], common_ancestor: list[list]) -> dict:
    """The `nvidia-smi topo -m` matrix from NVML: NV# where NVLink joins a pair, else the PCIe path."""

    def links(d: dict) -> list[tuple]:
        return list(zip(d.get("nvlink_remote_bus_ids") or [], d.get("nvlink_remote_types") or []))

    bus_ids = [str((d.get("nvmlDeviceGetPciInfo") or {}).get("busId", "")).lower() for d in devices]
    switch_links = [sum(1 for _, kind in links(d) if kind == NVLINK_REMOTE_SWITCH) for d in devices]
    matrix = []
    for i, device in enumerate(devices):
        row = []
        for j in range(len(devices)):
            direct = sum(1 for bus, _ in links(device) if str(bus).lower() == bus_ids[j])
            nv = direct or min(switch_links[i], switch_links[j])
            level = _nth(_nth(common_ancestor, i), j)
            pcie = NVML_TOPOLOGY_LABELS.get(level, "?") if isinstance(level, int) else "?"
            row.append("X" if i == j else f"NV{nv}" if nv else pcie)
        matrix.append(row)
    return {"source": "NVML (NVLink remote ends, topology common ancestor)",
            "devices": [f"GPU{i}" for i in range(len(devices))], "links": matrix}


def decide_form_factor(gpu: GpuInfo) -> tuple[str | None, str]:
    name = (gpu.name or "").upper()
    links = gpu.nvlink_active_links
    bridge = f"; its {links} active NVLink links are a bridge" if links else ""
    if "SXM" in name:
        return "sxm", "the name says SXM"
    if re.search(r"\bNVL\b", name):
        return "nvl", "the name says NVL (a PCIe card joined by NVLink bridges)"
    if "PCIE" in name:
        return "pcie", "the name says PCIe" + bridge
    if "GEFORCE" in name or "RTX" in name:
        return "pcie", "GeForce/RTX boards are only made as PCIe cards" + bridge
    if gpu.power_max_w is None:
        return None, "undecided: no SXM/NVL/PCIe marker in the name and no power limit"
    if gpu.power_max_w > PCIE_MAX_POWER_W:
        limit = f"board power limit {gpu.power_max_w:g} W"
        return "sxm", f"{limit} > {PCIE_MAX_POWER_W} W, the most any PCIe/NVL card draws"
    return "pcie", f"no SXM/NVL marker in the name and board power limit {gpu.power_max_w:g} W" + bridge


def match_profile(gpu: GpuInfo, profiles: dict[str, Profile]) -> tuple[Profile | None, str]:
    """The one profile whose name pattern, memory, power range and form factor fit; else None and why."""
    fits, misfits = [], []
    for profile in profiles.values():
        hints = profile.match
        if not hints or not any(re.search(p, gpu.name or "", re.IGNORECASE) for p in hints["name_patterns"]):
            continue
        why = []
        lo, hi = hints.get("memory_gib") or (0, float("inf"))
        if gpu.memory_gb is not None and not lo <= gpu.memory_gb <= hi:
            why.append(f"memory {gpu.memory_gb} GiB outside {lo}-{hi}")
        lo, hi = hints.get("power_limit_w") or (0, float("inf"))
        if gpu.power_max_w is not None and not lo <= gpu.power_max_w <= hi:
            why.append(f"power limit {gpu.power_max_w:g} W outside {lo}-{hi}")
        if gpu.form_factor and gpu.form_factor != profile.form_factor:
            why.append(f"form factor {gpu.form_factor}, profile {profile.form_factor}")
        (misfits if why else fits).append((profile, "; ".join(why)))
    if len(fits) == 1:
        profile = fits[0][0]
        return profile, f"{gpu.name}: name, memory, power limit and form factor fit profile {profile.name}"
    if fits:
        names = ", ".join(p.name for p, _ in fits)
        return None, f"{gpu.name} fits several profiles ({names}); form factor unknown"
    tried = "; ".join(f"{p.name}: {why}" for p, why in misfits) or "no profile's name pattern matches"
    return None, (
        f"no hardware profile matches {gpu.name} ({gpu.memory_gb} GiB, {gpu.power_max_w} W, "
        f"{gpu.form_factor}): {tried}; the tuner runs on the measured facts"
    )


def cpu_facts(evidence: dict) -> CpuInfo:
    cpu = CpuInfo()
    lscpu = evidence.get("cpu") if isinstance(evidence.get("cpu"), str) else ""
    source = "lscpu" if lscpu else "/proc/cpuinfo"
    facts = parse_cpu_text(lscpu or evidence.get("cpuinfo") or "")
    cpu.model = facts.get("model name")
    cpu.evidence["model"] = source
    logical = int(facts["cpu(s)"]) if "cpu(s)" in facts else evidence.get("cpuinfo_processors")
    cpu.cores, cpu.evidence["cores"] = logical, f"{source} logical CPUs"
    limits = (evidence.get("usable_cpus"), "CPU affinity"), (evidence.get("cgroup_cpus"), "cgroup cpu.max")
    for limit, why in limits:
        if limit and (cpu.cores is None or limit < cpu.cores):
            cpu.cores, cpu.evidence["cores"] = int(max(1, limit)), f"{why} (of {logical} logical CPUs)"
    if "core(s) per socket" in facts:
        cpu.physical_cores = int(facts["core(s) per socket"]) * int(facts.get("socket(s)", 1))
        cpu.evidence["physical_cores"] = "lscpu Core(s) per socket x Socket(s)"
    flags = (facts.get("flags") or "").split()
    cpu.isa_flags = sorted(f for f in flags if f.startswith(("avx512", "amx")))
    cpu.avx512 = "avx512f" in flags
    cpu.amx = any(f.startswith("amx") for f in flags)
    for fact in ("isa_flags", "avx512", "amx"):
        cpu.evidence[fact] = f"{source} flags"
    mem_kib = re.search(r"MemTotal:\s+(\d+) kB", evidence.get("meminfo") or "")
    if mem_kib:
        cpu.ram_gb, cpu.evidence["ram_gb"] = round(int(mem_kib.group(1)) / 2**20, 1), "/proc/meminfo MemTotal"
    limit = evidence.get("cgroup_memory_max")
    if limit and (cpu.ram_gb is None or limit / GIB < cpu.ram_gb):
        cpu.ram_gb, cpu.evidence["ram_gb"] = round(limit / GIB, 1), "cgroup memory.max"
    thp = re.search(r"\[(\w+)\]", evidence.get("thp") or "")
    if thp:
        cpu.thp_mode = thp.group(1)
        cpu.evidence["thp_mode"] = "/sys/kernel/mm/transparent_hugepage/enabled"
    return cpu
