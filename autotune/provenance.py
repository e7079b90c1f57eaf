"""Where a study's numbers came from: the environment fingerprint (what `autotune ci` compares), the
software versions, and digests of the exact model files. Written to studies/<name>/provenance.json."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import optuna
import torch

from autotune import PROJECT_ROOT, __version__
from autotune.hardware import probe


def commit() -> str | None:
    """The autotune commit that produced the numbers: the checkout's HEAD, else AUTOTUNE_COMMIT (the commit a
    `git archive` export came from: it has no .git), else None. An installed package has no checkout, though
    its venv may sit in some other project's repository."""
    done = None
    if (PROJECT_ROOT / ".git").exists():
        try:
            done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                  timeout=10, check=False)
        except OSError:  # no git on this machine
            pass
    return (done and done.returncode == 0 and done.stdout.strip()) or os.environ.get("AUTOTUNE_COMMIT") or None


def fast_dtypes(hardware) -> list[str]:
    """Reduced-precision dtypes this machine runs natively (CUDA capability, else CPU ISA flags)."""
    if hardware.gpus and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return [d for d, ok in (("bfloat16", torch.cuda.is_bf16_supported()), ("float16", True),
                                ("float8", (major, minor) >= (8, 9))) if ok]
    units = hardware.cpu.native_units() if hardware.cpu else set()
    return [d for d, unit in (("bfloat16", "bf16"), ("float16", "fp16")) if unit in units]


def digest(path: str | None) -> str | None:
    """sha256 of a model file; for a checkpoint directory, of its files' contents in name order."""
    if not path or not Path(path).exists():
        return None
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def fingerprint(adapter, model: str | None, draft_model: str | None = None, hardware=None) -> dict:
    """What decides whether a tuned configuration still holds on this machine."""
    hw = hardware or probe()
    fp = {"gpus": sorted(g.name or "?" for g in hw.gpus), "driver": hw.driver_version, "cuda": hw.cuda_driver_version,
          "nvml": hw.nvml_version, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
          "engine": adapter.name, "engine_version": adapter.installed_version(),
          "model_sha256": digest(model), "draft_model_sha256": digest(draft_model) if draft_model else None}
    host = {"cpu": hw.cpu.model if hw.cpu else None, "torch_threads": torch.get_num_threads(),
            "fast_dtypes": fast_dtypes(hw)}
    fp.update({k: host[k] for k in adapter.facts.fingerprint_keys})
    return fp


def write(path: Path, *, hardware, adapter, model: str | None, draft_model: str | None, workload: str,
          space_source: str) -> dict:
    """provenance.json: the machine, the software versions, the exact model, the fingerprint."""
    # The fingerprint hashes the model files, which for a large checkpoint takes minutes: done once,
    # its digests reused below.
    model = model or adapter.default_model()
    fp = fingerprint(adapter, model, draft_model, hardware)
    info = {
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit(),
        "hardware": plain(hardware),
        "engine": adapter.name, "space": space_source, "workload": workload,
        "model": model, "model_sha256": fp["model_sha256"],
        "draft_model": draft_model, "draft_model_sha256": fp["draft_model_sha256"],
        "versions": {"autotune": __version__, "optuna": optuna.__version__, "torch": torch.__version__,
                     "cuda": torch.version.cuda, "python": platform.python_version()},
        "host": platform.node(),
        "fingerprint": fp,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2, default=str))
    return info


def plain(obj):
    """A dataclass tree (the hardware probe) as JSON-ready data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    return obj if isinstance(obj, (int, float, str, bool)) or obj is None else str(obj)
