"""Parsers for the text the probe collects: `nvidia-smi -q`, `nvidia-smi topo -m`, lscpu / /proc/cpuinfo."""

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_smi_q(text: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """`nvidia-smi -q` → (header facts, one dict per GPU). Nested sections become "Section/Key" paths."""
    header: dict[str, str] = {}
    gpus: list[dict[str, str]] = []
    current, stack = header, []  # stack: (indent, section name)
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("="):
            continue
        if re.match(r"GPU [0-9A-Fa-f]+:", line):  # "GPU 00000000:00:06.0" opens a GPU block
            current, stack = {"Bus Id": line[4:].strip()}, []
            gpus.append(current)
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key, sep, value = (
            line.strip().partition(" : ") if " : " in line else (line.strip().rstrip(":"), "", "")
        )
        key = key.strip()
        if sep:
            current["/".join([s for _, s in stack] + [key])] = value.strip()
        else:
            stack.append((indent, key))
    return header, gpus


def smi_value(gpu: dict[str, str], *paths: str) -> str | None:
    """The first of `paths` that nvidia-smi reported with a real value (not N/A)."""
    for path in paths:
        value = gpu.get(path)
        if value not in (None, "", "N/A", "[N/A]", "Not Supported", "[Not Supported]"):
            return value
    return None


def smi_number(gpu: dict[str, str], *paths: str) -> float | None:
    value = smi_value(gpu, *paths)
    match = re.match(r"[-+]?\d+(\.\d+)?", value or "")
    return float(match.group()) if match else None


def parse_topo(text: str) -> dict | None:
    """`nvidia-smi topo -m` → {"devices", "links": [[X, NV12, ..]], "cpu_affinity", "numa_affinity"}"""
    lines = [_ANSI.sub("", line) for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    columns = [c.strip() for c in lines[0].split("\t")]
    gpu_columns = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    rows = [line.split("\t") for line in lines[1:] if re.match(r"GPU\d+\t", line)]
    if not gpu_columns or len(rows) != len(gpu_columns):
        return None
    n_devices = len([c for c in columns if re.fullmatch(r"(GPU|NIC)\d+", c)])  # NIC columns follow the GPUs
    return {
        "source": "nvidia-smi topo -m",
        "devices": gpu_columns,
        "links": [[cell.strip() for cell in row[1 : 1 + len(gpu_columns)]] for row in rows],
        "cpu_affinity": [row[1 + n_devices].strip() if len(row) > 1 + n_devices else None for row in rows],
        "numa_affinity": [row[2 + n_devices].strip() if len(row) > 2 + n_devices else None for row in rows],
    }


def parse_cpu_text(text: str) -> dict[str, str]:
    """lscpu output or one /proc/cpuinfo block → {lower-cased key: value}."""
    facts = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            facts.setdefault(key.strip().lower(), value.strip())
    return facts
