"""PyPI, read for a resolver: a project's release files (https://pypi.org/pypi/NAME/json) and a wheel's own
METADATA, read by HTTP range requests from the end of the wheel (its zip directory) and the one member: a few
hundred KB of a wheel that may be hundreds of MB. The wheel's METADATA rather than the release's JSON because it
is the exact file installed (a release's JSON shows one file's requirements), and per-release JSON
(/pypi/NAME/VERSION/json) is not served by every PyPI mirror."""
import io
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from urllib.parse import urljoin

import httpx
from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

PYPI = "https://pypi.org/pypi"
BLOCK = 1 << 16  # bytes per range request: one holds a wheel's zip directory or a METADATA member, mostly


class IndexError_(Exception):
    """PyPI did not answer, or answered something a resolver cannot use."""


@dataclass(frozen=True)
class WheelFile:
    name: str  # canonical project name
    version: Version
    filename: str
    url: str
    sha256: str
    size: int
    tags: frozenset[Tag]
    requires_python: str | None


class _RemoteFile(io.RawIOBase):
    """A file on a web server as a seekable file, read in cached blocks of byte ranges (what zipfile needs)."""

    def __init__(self, client: httpx.Client, url: str, size: int):
        self.client, self.url, self.size, self.pos = client, url, size, 0
        self.blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def _block(self, i: int) -> bytes:
        if i not in self.blocks:
            last = min(self.size, (i + 1) * BLOCK) - 1
            r = self.client.get(self.url, headers={"Range": f"bytes={i * BLOCK}-{last}"})
            if r.status_code != 206:
                raise IndexError_(f"{self.url}: byte ranges not served (HTTP {r.status_code})")
            self.blocks[i] = r.content
        return self.blocks[i]

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.size - self.pos))
        done = 0
        while done < n:
            block = self._block((self.pos + done) // BLOCK)
            start = (self.pos + done) % BLOCK
            chunk = block[start:start + n - done]
            buffer[done:done + len(chunk)] = chunk
            done += len(chunk)
        self.pos += n
        return n


class Index:
    """One resolver's view of PyPI (answers cached for its lifetime)."""

    def __init__(self, base: str = PYPI, timeout_s: float = 60.0):
        self.base = base.rstrip("/")
        self.client = httpx.Client(timeout=timeout_s, follow_redirects=True)
        self._files: dict[str, list[WheelFile]] = {}
        self._requires: dict[str, list[str]] = {}

    def _get(self, url: str) -> httpx.Response:
        try:
            r = self.client.get(url)
        except httpx.HTTPError as e:
            raise IndexError_(f"PyPI unreachable ({url}): {type(e).__name__}: {e}") from e
        if r.status_code == 404:
            raise IndexError_(f"no project on PyPI: {url}")
        if r.status_code != 200:
            raise IndexError_(f"{url}: HTTP {r.status_code}")
        return r

    def wheels(self, name: str) -> list[WheelFile]:
        """Every wheel of every release of the project that is not yanked (any platform)."""
        name = canonicalize_name(name)
        if name not in self._files:
            url = f"{self.base}/{name}/json"
            releases = self._get(url).json().get("releases", {})
            files = []
            for text, uploads in releases.items():
                try:
                    version = Version(text)
                except InvalidVersion:
                    continue  # pre-PEP 440 releases no installer picks
                for u in uploads:
                    if u.get("packagetype") != "bdist_wheel" or u.get("yanked"):
                        continue
                    try:
                        _, _, _, tags = parse_wheel_filename(u["filename"])
                    except InvalidWheelFilename:
                        continue
                    # a mirror may give file URLs relative to the JSON's
                    files.append(WheelFile(name, version, u["filename"], urljoin(url, u["url"]), u["digests"]["sha256"], u["size"],
                                           frozenset(tags), u.get("requires_python")))
            self._files[name] = files
        return self._files[name]

    def requires(self, wheel: WheelFile) -> list[str]:
        """The wheel's Requires-Dist lines, as its METADATA states them."""
        if wheel.url not in self._requires:
            try:
                with zipfile.ZipFile(_RemoteFile(self.client, wheel.url, wheel.size)) as z:
                    member = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
                    text = z.read(member).decode("utf-8")
            except (httpx.HTTPError, zipfile.BadZipFile, StopIteration) as e:
                raise IndexError_(f"{wheel.filename}: METADATA unreadable: {type(e).__name__}: {e}") from e
            self._requires[wheel.url] = HeaderParser().parsestr(text).get_all("Requires-Dist") or []
        return self._requires[wheel.url]
