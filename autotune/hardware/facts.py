"""What a tuner must know about the machine; every fact keeps the evidence it came from."""

from dataclasses import asdict, dataclass, field

from autotune.hardware.profiles import Profile


@dataclass
class GpuInfo:
    index: int
    name: str | None = None
    memory_gb: float | None = None  # GiB as the driver reports the total
    compute_capability: str | None = None  # "9.0"
    architecture: str | None = None
    sm_count: int | None = None
    pcie_gen: int | None = None  # the link's maximum generation
    pcie_width: int | None = None
    nvlink_active_links: int | None = None
    power_limit_w: float | None = None  # enforced now
    power_default_w: float | None = None
    power_max_w: float | None = None  # the board's ceiling: what tells SXM from PCIe
    board_part_number: str | None = None
    mig_mode: str | None = None  # enabled | disabled | None (not supported / unknown)
    bus_id: str | None = None
    form_factor: str | None = None  # sxm | nvl | pcie | None (undecided)
    evidence: dict[str, str] = field(default_factory=dict)  # fact name → where it came from


# CPU ISA flags (as /proc/cpuinfo names them) that execute a type natively: AVX512-BF16 / AMX-BF16 for
# bfloat16, AVX512-FP16 / AMX-FP16 for float16 (Intel's ISA reference,
# https://www.intel.com/content/www/us/en/developer/articles/technical/intel-sdm.html). Without them
# torch converts to float32 around every op.
CPU_NATIVE_UNITS = {"bf16": {"avx512_bf16", "amx_bf16"}, "fp16": {"avx512_fp16", "amx_fp16"}}


@dataclass
class CpuInfo:
    model: str | None = None
    cores: int | None = None  # logical CPUs this process may use (affinity and cgroup quota applied)
    physical_cores: int | None = None
    avx512: bool = False
    amx: bool = False
    isa_flags: list[str] = field(default_factory=list)  # the avx512* / amx* flags present
    ram_gb: float | None = None
    thp_mode: str | None = None  # always | madvise | never
    evidence: dict[str, str] = field(default_factory=dict)

    def native_units(self) -> set[str]:
        """The reduced-precision formats ("bf16", "fp16") this CPU computes in natively."""
        flags = set(self.isa_flags or [])
        return {unit for unit, isa in CPU_NATIVE_UNITS.items() if flags & isa}


@dataclass
class Hardware:
    gpus: list[GpuInfo]
    topology: (
        dict | None
    )  # {"source", "devices", "links": matrix of X/NV#/PIX/PXB/PHB/NODE/SYS, ...}; None for < 2 GPUs
    driver_version: str | None
    cuda_driver_version: str | None
    nvml_version: str | None
    versions: dict[str, str | None]  # torch, sglang, vllm: installed version or None
    cpu: CpuInfo | None
    profile: Profile | None
    source: str  # "measured", "fixture <path>" or "planned from profile <name>"
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["gpu_count"] = self.gpu_count
        return data
