"""GGUF weight formats: the bytes per linear-layer weight of each llama-quantize type (the data and its
sources: autotune/data/gguf_types.yaml), and what a GGUF file is, from its header."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import yaml

TYPES_FILE = Path(__file__).resolve().parent.parent / "data" / "gguf_types.yaml"
GIB = 2**30
HEAD_TYPE = "Q6_K"  # llama-quant.cpp moves output.weight to Q6_K for every quantized type but Q8_0


@functools.cache
def _data() -> dict:
    return yaml.safe_load(TYPES_FILE.read_text())


def block_bytes(ggml_type: str) -> float:
    """Bytes per weight of one ggml block type (Q4_K: 144 bytes / 256 weights)."""
    size, weights = _data()["blocks"][ggml_type]
    return size / weights


def published_bytes(name: str) -> float:
    """Bytes per linear-layer weight implied by QUANT_OPTIONS' Llama-3-8B file size of type `name`: the size
    less the token embedding (at the base type) and the output head, over the linear weights."""
    ref, t = _data()["reference"], _data()["types"][name]
    rest = ref["token_embd"] * block_bytes(t["base"]) + ref["output"] * block_bytes(t.get("head", HEAD_TYPE))
    return (t["published_gib"] * GIB - rest) / ref["linear"]


@functools.cache
def bytes_per_weight() -> dict[str, float]:
    """llama-quantize type name -> bytes per linear-layer weight: a mix's from its published size, any
    other type's from its block."""
    return {name: published_bytes(name) if t.get("mix") else block_bytes(t["base"])
            for name, t in _data()["types"].items()}


class GGUFHeader(NamedTuple):
    architecture: str  # general.architecture ("clip": a vision projector, not a language model)
    file_type: str  # llama-quantize's name of general.file_type (Q4_K_M)


def read_header(path: str | Path) -> GGUFHeader:
    """A GGUF file's architecture and weight format; ValueError (one line) for a file that is no GGUF or
    has no general.file_type (llama-quantize and convert_hf_to_gguf.py write it)."""
    path = Path(path).resolve()
    return _read_header(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read_header(path: Path, mtime_ns: int) -> GGUFHeader:
    import gguf  # reading the header (with its vocabulary) takes a second or two: cached per file version

    try:
        fields = gguf.GGUFReader(path).fields
    except Exception as e:  # noqa: BLE001 - the gguf package raises bare ValueErrors/struct errors on junk
        raise ValueError(f"{path}: not a usable GGUF file ({type(e).__name__}: {e})") from None
    if "general.file_type" not in fields:
        raise ValueError(f"{path}: its header has no general.file_type, so its weight format is unknown")
    number = int(fields["general.file_type"].contents())
    if number not in {t.value for t in gguf.LlamaFileType}:
        raise ValueError(f"{path}: general.file_type {number} is not a type the installed gguf package names")
    name = gguf.LlamaFileType(number).name.removeprefix("MOSTLY_").removeprefix("ALL_")  # Q4_K_M, F32
    return GGUFHeader(str(fields["general.architecture"].contents()), name)
