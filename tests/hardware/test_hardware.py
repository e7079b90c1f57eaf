"""Hardware probing: real and spec-sheet fixtures classify right; this CPU machine probes for real."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pynvml
import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.hardware import classify_from_fixture, get_profile, load_profiles, probe, probe_from_evidence
from autotune.hardware.profiles import PROFILES_DIR

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hardware"


def test_real_h200_capture_is_h200_sxm_hopper_with_native_fp8():
    hw = classify_from_fixture(FIXTURES / "h200-sxm-1gpu")
    assert hw.gpu_count == 1
    gpu = hw.gpus[0]
    assert (gpu.name, gpu.compute_capability, gpu.architecture, gpu.sm_count) == (
        "NVIDIA H200",
        "9.0",
        "Hopper",
        132,
    )
    assert gpu.form_factor == "sxm" and "700 W" in gpu.evidence["form_factor"]
    assert gpu.memory_gb == pytest.approx(140.4, abs=0.1) and gpu.evidence["memory_gb"].startswith("NVML")
    assert (gpu.pcie_gen, gpu.pcie_width, gpu.mig_mode, gpu.nvlink_active_links) == (5, 16, "disabled", 0)
    assert gpu.board_part_number == "692-2G520-0282-000"
    assert (
        hw.profile.name == "h200-sxm" and hw.profile.fp8_mode == "native" and "fp8" in hw.profile.peak_tflops
    )
    assert (hw.driver_version, hw.cuda_driver_version, hw.nvml_version) == (
        "580.159.04",
        "13.0",
        "13.580.159.04",
    )
    assert hw.versions == {"sglang": None, "vllm": None, "torch": "2.11.0+cu130"}
    assert hw.cpu.amx and hw.cpu.avx512 and hw.cpu.cores == 16 and hw.cpu.thp_mode == "madvise"
    assert hw.topology is None  # one GPU: nothing to connect
    json.dumps(hw.to_dict())  # JSON-able as the CLI prints it


def test_h200_classifies_from_nvidia_smi_text_alone(tmp_path):
    for name in ("nvidia-smi-q.txt", "nvidia-smi-topo.txt"):
        shutil.copy(FIXTURES / "h200-sxm-1gpu" / name, tmp_path / name)
    hw = classify_from_fixture(tmp_path)
    gpu = hw.gpus[0]
    assert hw.profile.name == "h200-sxm" and gpu.form_factor == "sxm"
    assert gpu.evidence["power_max_w"] == "nvidia-smi -q Max Power Limit" and gpu.power_max_w == 700
    assert (
        gpu.compute_capability == "9.0"
        and gpu.evidence["compute_capability"] == "not measured: profile h200-sxm"
    )
    assert hw.driver_version == "580.159.04" and hw.cuda_driver_version == "13.0"


def h200_capture(name=None, power_max_w=None, memory_gib=None, power_limit_w=None) -> dict:
    """The real H200 SXM capture's evidence (NVML answers as gather() recorded them), with the facts
    that decide a board changed: a board we have no capture of, built from one we have."""
    evidence = json.loads((FIXTURES / "h200-sxm-1gpu" / "probe.json").read_text())
    device = evidence["devices"][0]
    if name is not None:
        device["nvmlDeviceGetName"] = name
    if power_max_w is not None:  # the board's range, as the 2-GPU capture's driver reports it
        device["nvmlDeviceGetPowerManagementLimitConstraints"] = [200_000, power_max_w * 1000]
    if power_limit_w is not None:
        device["nvmlDeviceGetEnforcedPowerLimit"] = device["nvmlDeviceGetPowerManagementLimit"] = power_limit_w * 1000
    if memory_gib is not None:
        device["nvmlDeviceGetMemoryInfo"]["total"] = int(memory_gib * 2**30)
    return evidence


# The synthetic spec-sheet fixtures are built from the same sheets as the profiles, so "fixture X
# classifies as profile X" proves nothing. What can be wrong is the decision itself: which measured fact
# rules a profile out. These cases move one fact of the real capture across a profile's boundary.
@pytest.mark.parametrize(
    "changes, profile, form_factor, why",
    [
        ({}, "h200-sxm", "sxm", "700 W > 600 W"),  # the capture as it is: no SXM in the name, the power decides
        ({"power_limit_w": 350, "power_max_w": 700}, "h200-sxm", "sxm", "700 W > 600 W"),  # capped: its ceiling counts
        ({"power_max_w": 600}, None, "pcie", "h200-sxm: power limit 600 W outside 601-1000; form factor pcie"),
        ({"name": "NVIDIA H200 NVL", "power_max_w": 600}, "h200-nvl", "nvl", "the name says NVL"),
        ({"name": "NVIDIA H200 NVL"}, None, "nvl", "h200-nvl: power limit 700 W outside 300-600; h200-sxm: form factor nvl"),
        ({"memory_gib": 80}, None, "sxm", "h200-sxm: memory 80.0 GiB outside 135-145"),
        ({"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.6}, "h100-sxm5", "sxm", "700 W > 600 W"),
    ],
)
def test_one_measured_fact_decides_the_profile(changes, profile, form_factor, why):
    hw = probe_from_evidence(h200_capture(**changes))
    gpu = hw.gpus[0]
    assert gpu.form_factor == form_factor, gpu.evidence["form_factor"]
    assert (hw.profile.name if hw.profile else None) == profile, hw.notes
    assert why in gpu.evidence["form_factor"] + " | " + " | ".join(hw.notes)


def test_synthetic_fixtures_parse_links_and_form_factor():
    # What the synthetic fixtures can still check: facts parsed from NVML's answers (not from a profile).
    for fixture, gpus, form_factor, links in [("a100-sxm4-80gb-8gpu", 8, "sxm", 12),
                                              ("rtx-a6000-2gpu-nvlink-bridge", 2, "pcie", 4),
                                              ("l40s-1gpu", 1, "pcie", 0), ("h200-nvl-1gpu", 1, "nvl", 0)]:
        hw = classify_from_fixture(FIXTURES / fixture)
        assert hw.gpu_count == gpus and {(g.form_factor, g.nvlink_active_links) for g in hw.gpus} == {
            (form_factor, links)}, fixture


def test_eight_a100s_on_nvswitch_topology_from_text_and_from_nvml(tmp_path):
    hw = classify_from_fixture(FIXTURES / "a100-sxm4-80gb-8gpu")
    topo = hw.topology
    assert topo["source"] == "nvidia-smi topo -m" and topo["devices"] == [f"GPU{i}" for i in range(8)]
    assert all(topo["links"][i][j] == ("X" if i == j else "NV12") for i in range(8) for j in range(8))
    assert topo["cpu_affinity"][0] == "48-63,176-191" and topo["numa_affinity"][2] == "1"
    shutil.copy(FIXTURES / "a100-sxm4-80gb-8gpu" / "probe.json", tmp_path / "probe.json")  # no topo text
    from_nvml = classify_from_fixture(tmp_path).topology
    assert from_nvml["source"].startswith("NVML") and from_nvml["links"] == topo["links"]


def test_nvlink_bridge_keeps_a6000s_pcie_and_shows_nv4():
    hw = classify_from_fixture(FIXTURES / "rtx-a6000-2gpu-nvlink-bridge")
    assert hw.topology["links"] == [["X", "NV4"], ["NV4", "X"]]
    assert "bridge" in hw.gpus[0].evidence["form_factor"]


def test_a_gpu_without_profile_is_reported_unmatched_with_reasons():
    hw = classify_from_fixture(FIXTURES / "h100-nvl-1gpu-unmatched")
    assert hw.profile is None and hw.gpus[0].form_factor == "nvl"
    note = next(n for n in hw.notes if "no hardware profile matches" in n)
    assert (
        "NVIDIA H100 NVL" in note
        and "h100-sxm5: memory 93.6 GiB outside" in note
        and "measured facts" in note
    )


def test_cpu_facts_and_thp_always_warning():
    hw = classify_from_fixture(FIXTURES / "a100-sxm4-80gb-8gpu")
    assert hw.cpu.model == "AMD EPYC 7742 64-Core Processor" and hw.cpu.cores == 256
    assert hw.cpu.ram_gb == pytest.approx(2015.7, abs=0.1) and not hw.cpu.avx512
    assert hw.cpu.thp_mode == "always" and any("transparent huge pages = always" in w for w in hw.warnings)


def test_mig_and_power_cap_are_warned():
    evidence = json.loads((FIXTURES / "a100-sxm4-40gb-1gpu" / "probe.json").read_text())
    evidence["devices"][0]["nvmlDeviceGetMigMode"] = [1, 1]
    evidence["devices"][0]["nvmlDeviceGetEnforcedPowerLimit"] = 250_000
    hw = probe_from_evidence(evidence)
    assert hw.gpus[0].mig_mode == "enabled" and hw.gpus[0].power_limit_w == 250
    assert any("MIG enabled" in w for w in hw.warnings) and any("250 W is below" in w for w in hw.warnings)
    assert hw.profile.name == "a100-40gb-sxm4"  # matched on the board's ceiling, not the cap


def test_profiles_are_complete_and_consistent():
    profiles = load_profiles()
    expected = {
        "a100-40gb-sxm4",
        "a100-80gb-sxm4",
        "a100-80gb-pcie",
        "h100-sxm5",
        "h100-pcie",
        "h200-sxm",
        "h200-nvl",
        "rtx-a6000",
        "rtx-3090",
        "l40s",
        "cpu",
    }
    assert expected <= set(profiles)
    for p in profiles.values():
        assert p.source_url.startswith("https://"), p.name
        if not p.is_gpu:
            assert p.fp8_mode == "none" and p.match is None
            continue
        cc = tuple(map(int, p.compute_capability.split(".")))
        assert p.fp8_mode == ("native" if cc >= (8, 9) else "marlin_w8a16"), p.name
        assert ("fp8" in p.peak_tflops) == (p.fp8_mode == "native")  # FP8 units: a peak of their own
        assert p.memory_gb > 0 and p.memory_bandwidth_gbps > 0 and p.power_limit_w > 0
        assert (
            p.peak_tflops["fp32"] <= p.peak_tflops["tf32"] <= p.peak_tflops["bf16"] <= p.peak_tflops["int8"]
        )
        assert p.interconnect["pcie"]["generation"] in (4, 5)
        lo, hi = p.match["power_limit_w"]
        assert lo <= p.power_limit_w <= hi, p.name


def test_user_profile_dropped_in_a_folder_is_loaded_and_plannable(tmp_path):
    shipped = (PROFILES_DIR / "l40s.yaml").read_text()
    (tmp_path / "l40-custom.yaml").write_text(shipped.replace("memory_gb: 48", "memory_gb: 47"))
    hw = probe("l40-custom", profiles_dir=tmp_path)
    assert hw.profile.name == "l40-custom" and hw.gpus[0].memory_gb == 47 and hw.source.startswith("planned")
    for broken in ("description: x\nform_factor: tpu\n", "a: [1,\n", shipped.replace("[43, 46.5]", "43")):
        (tmp_path / "broken.yaml").write_text(broken)
        with pytest.raises(ValueError, match="broken.yaml") as error:
            load_profiles(tmp_path)
        assert "\n" not in str(error.value)


def test_unknown_profile_is_a_one_line_error_listing_the_known_ones():
    with pytest.raises(ValueError) as error:
        get_profile("h300")
    message = str(error.value)
    assert "\n" not in message and "h300" in message
    assert all(name in message for name in load_profiles())


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = Path("/sys/fs/cgroup/cpu.max")
    if quota.exists() and quota.read_text().split()[0].isdigit():
        limit, period = map(int, quota.read_text().split())
        cores = min(cores, max(1, int(limit / period)))
    return cores


def probe_json(*args) -> dict:
    done = subprocess.run(["autotune", "probe", "--json", *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_cli_probe_json_measures_this_machine_as_a_cpu_machine():
    # --gpu cpu: the CPU profile because the test asks for it, whether or not this machine has GPUs.
    report = probe_json("--gpu", "cpu")
    assert report["profile"]["name"] == "cpu" and report["gpu_count"] == 0 and report["source"] == "measured"
    assert "GPUs not probed: --gpu cpu asks for the CPU profile" in report["notes"]
    cpu = report["cpu"]
    assert cpu["cores"] == usable_cores() and cpu["model"]
    mem_total_kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    assert 0 < cpu["ram_gb"] <= round(mem_total_kib / 2**20, 1)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        assert f"[{cpu['thp_mode']}]" in thp.read_text()


def test_cli_probe_json_auto_counts_the_gpus_nvml_sees():
    try:  # asked independently of the probe
        pynvml.nvmlInit()
        gpus = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        gpus = 0
    report = probe_json()
    assert report["gpu_count"] == gpus and report["source"] == "measured"
    assert (report["profile"] is not None and report["profile"]["name"] == "cpu") == (gpus == 0)
    assert report["cpu"]["cores"] == usable_cores()


def test_cli_unknown_gpu_exits_2_with_one_line():
    done = subprocess.run(
        ["autotune", "probe", "--gpu", "h300"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "error: unknown hardware profile 'h300'; known:"
    )
    assert "rtx-a6000" in done.stderr


def test_cli_tables_for_a_planned_machine():
    result = CliRunner().invoke(app, ["probe", "--gpu", "h100-pcie"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert (
        "planned from profile h100-pcie" in result.output and "NVIDIA H100 PCIe 80GB HBM2e" in result.output
    )
    assert "resources.nvidia.com" in result.output and "native" in result.output


def _raise_nvml(*args):
    raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)


def test_nvml_failing_at_init_degrades_to_a_note(monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlInit", _raise_nvml)
    hw = probe()
    assert hw.profile.name == "cpu" and hw.gpus == []
    assert any(note.startswith("NVML: NVMLError") for note in hw.notes)


def test_nvml_failing_on_every_query_degrades_to_notes(monkeypatch):
    for name in dir(pynvml):
        if name.startswith(("nvmlDevice", "nvmlSystem")) or name == "nvmlShutdown":
            monkeypatch.setattr(pynvml, name, _raise_nvml)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"handle{i}")
    hw = probe()
    assert hw.gpu_count == 2 and hw.gpus[0].name is None and hw.profile is None
    assert hw.driver_version is None and hw.topology["links"][0] == ["X", "?"]
    assert any("no hardware profile matches" in n for n in hw.notes)
    result = CliRunner().invoke(app, ["probe"], env={"COLUMNS": "250"})
    assert result.exit_code == 0 and "none matched" in result.output


def test_real_two_h200_capture_has_nvlink_through_nvswitch(tmp_path):
    hw = classify_from_fixture(FIXTURES / "h200-sxm-2gpu")  # gather()'s own output on 2x H200 SXM
    assert hw.gpu_count == 2 and hw.profile.name == "h200-sxm"
    assert all((g.nvlink_active_links, g.form_factor, g.power_max_w) == (18, "sxm", 700) for g in hw.gpus)
    assert hw.gpus[0].evidence["power_max_w"] == "NVML nvmlDeviceGetPowerManagementLimitConstraints"
    assert hw.topology["source"] == "nvidia-smi topo -m"
    assert hw.topology["links"] == [["X", "NV18"], ["NV18", "X"]]
    evidence = json.loads((FIXTURES / "h200-sxm-2gpu" / "probe.json").read_text())
    del evidence["nvidia_smi_topo"]  # all 18 links end at NVSwitches: NVML alone must still see NV18
    assert probe_from_evidence(evidence).topology["links"] == [["X", "NV18"], ["NV18", "X"]]
