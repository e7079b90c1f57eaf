"""Cut wheels into parts that one transfer carries, group the parts into batches of at most that size, and
join parts back into the file they came from."""
import os
from dataclasses import dataclass
from pathlib import Path

from autotune.bundle.download import CHUNK, sha256_of

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'60M' -> 62914560 (binary units: K, M, G; a plain number is bytes)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    try:
        value = float(text[:len(text) - len(unit)])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 40M, 1G, 1048576)") from None
    if value <= 0:
        raise ValueError(f"a part size must be positive, got {text!r}")
    return int(value * UNITS[unit])


@dataclass(frozen=True)
class Part:
    name: str  # file name: the wheel's own, or WHEEL.partNNN for a piece of a larger wheel
    wheel: str  # the file it is cut from: the wheel, or the wheel packed for the trip (WHEEL.zst, pack.py)
    index: int  # its place among the wheel's pieces (0 for a whole wheel)
    size: int
    sha256: str


def split_file(path: Path, part_size: int, out_dir: Path) -> list[Part]:
    """The file as parts of at most part_size bytes in out_dir: itself (hard-linked) if it fits, else pieces."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if path.stat().st_size <= part_size:
        target = out_dir / path.name
        if not target.exists():
            os.link(path, target)
        return [Part(path.name, path.name, 0, path.stat().st_size, sha256_of(path))]
    parts = []
    with path.open("rb") as f:
        index = 0
        while block := f.read(part_size):
            name = f"{path.name}.part{index:03d}"
            (out_dir / name).write_bytes(block)
            parts.append(Part(name, path.name, index, len(block), sha256_of(out_dir / name)))
            index += 1
    return parts


def join(pieces: list[Path], out: Path) -> Path:
    """The pieces, in the order given, written back as one file."""
    with out.open("wb") as dst:
        for piece in pieces:
            with piece.open("rb") as src:
                while block := src.read(CHUNK):
                    dst.write(block)
    return out


def batches(parts: list[Part], limit: int) -> list[list[Part]]:
    """Parts grouped first-fit, largest first, into batches of at most `limit` bytes: one transfer each."""
    groups: list[list[Part]] = []
    room: list[int] = []
    for part in sorted(parts, key=lambda p: (-p.size, p.name)):
        i = next((i for i, r in enumerate(room) if r >= part.size), None)
        if i is None:
            groups.append([])
            room.append(limit)
            i = len(groups) - 1
        groups[i].append(part)
        room[i] -= part.size
    return groups
