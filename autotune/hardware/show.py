"""Rich tables for `autotune probe`: every fact next to the evidence it came from."""

from rich.table import Table

from autotune.hardware.facts import Hardware

GPU_FACTS = (
    "name",
    "memory_gb",
    "compute_capability",
    "architecture",
    "sm_count",
    "pcie_gen",
    "pcie_width",
    "nvlink_active_links",
    "power_limit_w",
    "power_default_w",
    "power_max_w",
    "board_part_number",
    "mig_mode",
    "bus_id",
    "form_factor",
)
CPU_FACTS = ("model", "cores", "physical_cores", "avx512", "amx", "isa_flags", "ram_gb", "thp_mode")


def _facts_table(title: str, obj, facts: tuple[str, ...]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("fact", "value", "evidence"):
        table.add_column(column)
    for fact in facts:
        value = getattr(obj, fact)
        shown = ", ".join(value) if isinstance(value, list) else ("-" if value is None else str(value))
        table.add_row(fact, shown, obj.evidence.get(fact, "-"), style="dim" if value is None else None)
    return table


def tables(hardware: Hardware) -> list[Table]:
    out = [_facts_table(f"GPU{g.index}", g, GPU_FACTS) for g in hardware.gpus]
    if hardware.topology:
        topo = hardware.topology
        table = Table(title=f"GPU topology ({topo['source']})", title_justify="left")
        table.add_column("")
        for device in topo["devices"]:
            table.add_column(device)
        for device, row in zip(topo["devices"], topo["links"]):
            table.add_row(device, *row)
        out.append(table)
    system = Table(title="System", title_justify="left")
    system.add_column("fact")
    system.add_column("value")
    system.add_row("facts", hardware.source)
    for fact in ("driver_version", "cuda_driver_version", "nvml_version"):
        system.add_row(fact, getattr(hardware, fact) or "-")
    for package, version in hardware.versions.items():
        system.add_row(package, version or "not installed")
    out.append(system)
    if hardware.cpu:
        out.append(_facts_table("CPU", hardware.cpu, CPU_FACTS))
    profile = hardware.profile
    table = Table(title="Matched hardware profile", title_justify="left")
    table.add_column("field")
    table.add_column("value")
    if profile is None:
        table.add_row("profile", "none matched: the tuner runs on the measured facts")
    else:
        nvlink, pcie = profile.interconnect.get("nvlink"), profile.interconnect.get("pcie")
        links = []
        if nvlink:
            links.append(f"NVLink {nvlink['generation']} ({nvlink['via']}) {nvlink['bandwidth_gbps']} GB/s")
        if pcie:
            links.append(f"PCIe Gen{pcie['generation']} {pcie['bandwidth_gbps']} GB/s")
        rows = {
            "profile": f"{profile.name}: {profile.description}",
            "memory": f"{profile.memory_gb} GB at {profile.memory_bandwidth_gbps} GB/s"
            if profile.memory_gb
            else "not in the profile: see the measured facts",
            "dense peak TFLOP/s": ", ".join(
                f"{k} {'?' if v is None else v}" for k, v in profile.peak_tflops.items()
            ),
            "FP8": profile.fp8_mode,
            "interconnect": ", ".join(links) or "-",
            "power limit": f"{profile.power_limit_w} W" if profile.power_limit_w else "-",
            "spec sheet": profile.source_url,
        }
        for field, value in rows.items():
            table.add_row(field, str(value))
    out.append(table)
    return out
