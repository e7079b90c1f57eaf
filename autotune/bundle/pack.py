"""Pack a wheel smaller for the trip: its members re-stored uncompressed, then the whole compressed with zstd and a
long window. Deflate compresses each member alone with a 32 KiB window, so a library of many near-identical
kernels stays large (sglang-kernel's FA3 library: 1.12 GB, 340 MB deflated, 145 MB this way). The stored wheel
is a valid wheel with the same members and RECORD; install.sh decompresses it and checks its sha256 (taken here)
before pip installs it."""
import zipfile
from dataclasses import dataclass
from pathlib import Path

import zstandard

from autotune.bundle.download import CHUNK, sha256_of

SUFFIX = ".zst"
WINDOW_LOG = 30  # 1 GiB: a match reaches across a whole large library; install.sh decompresses with --long=31
LEVEL = 15  # higher levels take minutes on a GB for a few percent
WORTH = 0.85  # packed only where it leaves at most this share of the deflated wheel (else it travels as it is)


@dataclass(frozen=True)
class Packed:
    path: Path  # WHEEL.zst
    stored_sha256: str  # the stored wheel's, which install.sh checks after decompressing


def stored_copy(wheel: Path, out: Path) -> Path:
    """The wheel with every member re-written uncompressed, in the same order and with the same names."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            copy.external_attr, copy.compress_type = info.external_attr, zipfile.ZIP_STORED
            with src.open(info) as member, dst.open(copy, "w", force_zip64=info.file_size > 2**31) as target:
                while block := member.read(CHUNK):
                    target.write(block)
    return out


def compress(path: Path, out: Path) -> Path:
    params = zstandard.ZstdCompressionParameters.from_level(LEVEL, window_log=WINDOW_LOG, enable_ldm=True,
                                                            threads=-1)
    with path.open("rb") as src, out.open("wb") as dst:
        zstandard.ZstdCompressor(compression_params=params).copy_stream(src, dst)
    return out


def pack(wheel: Path, folder: Path) -> Packed | None:
    """The wheel stored and compressed into `folder`, or None where that saves too little to be worth a step."""
    folder.mkdir(parents=True, exist_ok=True)
    stored = stored_copy(wheel, folder / wheel.name)
    try:
        packed = compress(stored, folder / (wheel.name + SUFFIX))
        if packed.stat().st_size > WORTH * wheel.stat().st_size:
            packed.unlink()
            return None
        return Packed(packed, sha256_of(stored))
    finally:
        stored.unlink()
