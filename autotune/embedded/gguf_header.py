"""A GGUF file's header (its metadata and tensor index), read by the gguf package once per file version and kept
on disk: the package's reader walks a 49k-token vocabulary element by element (2.7 s for the bundled model on a
CPU core), which every engine launch, plan, validation and tokenizer paid again.

    header = read_header(path)            # ValueError naming the file if it is not a readable GGUF
    header.meta["general.architecture"]   # every field's contents, as the gguf package gives them
    for t in header.tensors:              # name, tensor_type, shape (GGUF order), n_elements, n_bytes
        t.data                            # a read-only view of the mapped file, as gguf.ReaderTensor.data
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import numpy as np

from autotune import cache_dir

FORMAT = 1  # of the cached JSON; a change makes earlier entries misses
PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}  # stored as numbers, not blocks (gguf_reader's own split)


@dataclass(frozen=True)
class Tensor:
    name: str
    type_number: int
    shape: tuple[int, ...]  # GGUF order: the row length first
    n_elements: int
    n_bytes: int
    offset: int  # from the start of the file
    file: np.memmap = field(repr=False, compare=False)

    @property
    def tensor_type(self):
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_number)

    @property
    def data(self) -> np.ndarray:
        """Numbers for the plain types, block bytes [rows, row bytes] for the quantized ones (as the gguf reader)."""
        from gguf import quant_shape_to_byte_shape

        raw, kind, dims = self.file[self.offset:self.offset + self.n_bytes], self.tensor_type, tuple(reversed(self.shape))
        if kind.name in PLAIN_TYPES:
            return raw.view(PLAIN_TYPES[kind.name]).reshape(dims)
        return raw.reshape(quant_shape_to_byte_shape(dims, kind))


@dataclass(frozen=True)
class Header:
    meta: dict
    tensors: list[Tensor]


def read_header(path: str | Path) -> Header:
    path = Path(path).expanduser().resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e.strerror})") from None
    return _read(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read(path: Path, size: int, mtime_ns: int) -> Header:
    key = hashlib.sha256(f"{FORMAT}|{version('gguf')}|{path}|{size}|{mtime_ns}".encode()).hexdigest()[:24]
    cached = cache_dir("gguf", f"{path.stem}-{key}.json")
    try:
        doc = json.loads(cached.read_text())
    except (OSError, ValueError):
        doc = _parse(path)
        _store(cached, doc)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    return Header(doc["meta"], [Tensor(name, number, tuple(shape), n_elements, n_bytes, offset, file)
                                for name, number, shape, n_elements, n_bytes, offset in doc["tensors"]])


def _parse(path: Path) -> dict:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - on junk the gguf package raises whatever its parse hits
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    return {"meta": {k: f.contents() for k, f in reader.fields.items()},
            "tensors": [[t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.n_elements), int(t.n_bytes),
                         int(t.data_offset)] for t in reader.tensors]}


def _store(cached: Path, doc: dict) -> None:
    """Written whole or not at all (a rename); a cache that cannot be written costs the next reader a parse."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps(doc))
        partial.replace(cached)
    except OSError:
        pass
