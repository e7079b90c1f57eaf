"""Fetch the resolved wheels into a folder, each checked against the sha256 the index publishes. A wheel already
there with the right hash is kept (a bundle of a GB is fetched again only where it changed)."""
import hashlib
from pathlib import Path

import httpx

from autotune.bundle.index import WheelFile

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def fetch(wheel: WheelFile, folder: Path, client: httpx.Client) -> Path:
    """The wheel in `folder`, downloaded unless already there intact; ValueError if the download is not it."""
    path = folder / wheel.filename
    if path.exists() and path.stat().st_size == wheel.size and sha256_of(path) == wheel.sha256:
        return path
    partial = path.with_name(path.name + ".download")
    digest = hashlib.sha256()
    with client.stream("GET", wheel.url) as r, partial.open("wb") as out:
        r.raise_for_status()
        for block in r.iter_bytes(CHUNK):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != wheel.sha256:
        partial.unlink()
        raise ValueError(f"{wheel.filename}: sha256 {digest.hexdigest()} is not the index's {wheel.sha256}")
    partial.replace(path)
    return path


def fetch_all(wheels: list[WheelFile], folder: Path, progress=None) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    with httpx.Client(timeout=httpx.Timeout(60.0, read=300.0), follow_redirects=True) as client:
        paths = []
        for wheel in wheels:
            paths.append(fetch(wheel, folder, client))
            if progress:
                progress(wheel)
        return paths
