"""GGUF weight formats: the bytes per linear-layer weight of each llama-quantize type, the ggml types it
stores the output head and token embedding at (the data and its sources: autotune/data/gguf_types.yaml),
and what a GGUF file is, from its header."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import yaml

from autotune import package_path

TYPES_FILE = package_path("data", "gguf_types.yaml")
GIB = 2**30
UNQUANTIZED = ("F32", "F16", "BF16")  # types llama-quant.cpp's rules leave alone


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
    rest = ref["token_embd"] * block_bytes(t["base"]) + ref["output"] * block_bytes(t["head"])
    return (t["published_gib"] * GIB - rest) / ref["linear"]


@functools.cache
def bytes_per_weight() -> dict[str, float]:
    """llama-quantize type name -> bytes per linear-layer weight: a mix's from its published size, any
    other type's from its block."""
    return {name: published_bytes(name) if t.get("mix") else block_bytes(t["base"])
            for name, t in _data()["types"].items()}


def _fitted(ggml_type: str, row: int) -> str:
    """The type a tensor of `row` weights a row gets for `ggml_type` (tensor_type_fallback): itself where its
    blocks fill the row, else its fallback, else F16."""
    weights = _data()["blocks"][ggml_type][1]
    if row % weights == 0:
        return ggml_type
    fallback = _data()["fallback"].get(ggml_type, ggml_type)
    return fallback if row % _data()["blocks"][fallback][1] == 0 else "F16"


def head_type(name: str, row: int) -> str:
    """The ggml type llama-quantize stores output.weight at in a file of type `name` whose rows (the hidden
    size) hold `row` weights."""
    t = _data()["types"][name]
    if t["base"] in UNQUANTIZED:
        return t["base"]
    return _fitted("Q8_0" if row % _data()["blocks"][t["base"]][1] else t["head"], row)


def embedding_type(name: str, row: int, tied: bool) -> str:
    """The ggml type of token_embd.weight in a file of type `name`: the head's where the model ties them."""
    t = _data()["types"][name]
    if tied:
        return head_type(name, row)
    return t["base"] if t["base"] in UNQUANTIZED else _fitted(t.get("token_embd", t["base"]), row)


class TensorSize(NamedTuple):
    weights: int
    bytes: int


class GGUFHeader(NamedTuple):
    architecture: str  # general.architecture ("clip": a vision projector, not a language model)
    file_type: str  # llama-quantize's name of general.file_type (Q4_K_M)
    parts: int = 1  # split.count: a split model's first part need not hold output.weight
    embedding: TensorSize | None = None  # token_embd.weight
    head: TensorSize | None = None  # output.weight; None: the model ties it to the embedding


def read_header(path: str | Path) -> GGUFHeader:
    """A GGUF file's architecture, weight format and the sizes of its embedding and head; ValueError (one
    line) for a file that is no GGUF or has no general.file_type (llama-quantize and convert_hf_to_gguf.py
    write it)."""
    import gguf

    from autotune.embedded import gguf_header  # the header read once per file version (seconds), kept on disk

    path = Path(path).resolve()
    header = gguf_header.read_header(path)  # ValueError naming the file for junk
    fields = header.meta
    if "general.file_type" not in fields:
        raise ValueError(f"{path}: its header has no general.file_type, so its weight format is unknown")
    number = int(fields["general.file_type"])
    if number not in {t.value for t in gguf.LlamaFileType}:
        raise ValueError(f"{path}: general.file_type {number} is not a type the installed gguf package names")
    name = gguf.LlamaFileType(number).name.removeprefix("MOSTLY_").removeprefix("ALL_")  # Q4_K_M, F32
    sizes = {t.name: TensorSize(t.n_elements, t.n_bytes) for t in header.tensors}
    parts = int(fields["split.count"]) if "split.count" in fields else 1
    return GGUFHeader(str(fields["general.architecture"]), name, parts, sizes.get("token_embd.weight"),
                      sizes.get("output.weight"))


def stored_bytes(source: str, name: str, row: int, tied: bool) -> tuple[float, float]:
    """Bytes per weight of the token embedding and of the output head in a model's GGUF file of type `name`:
    the file's own (its header's sizes) where `source` (the file the model was read from) or a file of the
    same model beside it is of that type, else llama-quantize's rules for that type (`row`: the hidden size)."""
    header = _header_of_type(source, name)
    if header is None:
        return (block_bytes(embedding_type(name, row, tied)), block_bytes(head_type(name, row)))
    embedding, head = header.embedding, header.head or header.embedding  # a tied head is the embedding
    return embedding.bytes / embedding.weights, head.bytes / head.weights


def _header_of_type(source: str, name: str) -> GGUFHeader | None:
    """The header of the GGUF file of type `name` among `source` and the files beside it of the same model
    (architecture and embedding size alike, as a --model directory holds one model's files); None when there
    is none, or its head may lie in another part of a split model."""
    path = Path(source)
    if path.suffix != ".gguf" or not path.is_file():
        return None
    own = read_header(path)
    if own.embedding is None:
        return None
    for file in [path, *sorted(path.parent.glob("*.gguf"))]:
        try:
            header = read_header(file)
        except ValueError:  # a later part of a split model, a file of no known type
            continue
        if (header.file_type == name and header.parts == 1 and header.architecture == own.architecture
                and header.embedding is not None and header.embedding.weights == own.embedding.weights):
            return header
    return None
