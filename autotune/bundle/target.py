"""The machine a bundle is for: its Python, its platform and what its `pip freeze` says is installed."""
from dataclasses import dataclass, field
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name


@dataclass(frozen=True)
class Target:
    python: str = "3.12"  # "3.12" or "3.12.3"
    machine: str = "x86_64"
    # the newest glibc the machine runs manylinux_2_N wheels of; 2.35 (Ubuntu 22.04) is the oldest glibc of the
    # CUDA 13 images, so wheels chosen for it run on a newer one too
    glibc: tuple[int, int] = (2, 35)
    installed: dict[str, str | None] = field(default_factory=dict)  # canonical name -> version (None: unknown)

    @property
    def python_tuple(self) -> tuple[int, int]:
        major, minor = self.python.split(".")[:2]
        return int(major), int(minor)

    def markers(self, extra: str = "") -> dict[str, str]:
        """The PEP 508 marker environment of the target (not of this machine)."""
        full = ".".join((self.python.split(".") + ["0"])[:3])
        return {"implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
                "platform_machine": self.machine, "platform_release": "", "platform_system": "Linux",
                "platform_version": "", "python_full_version": full, "platform_python_implementation": "CPython",
                "python_version": "{}.{}".format(*self.python_tuple), "sys_platform": "linux", "extra": extra}

    def platforms(self) -> list[str]:
        """manylinux platform tags it runs, newest first (PEP 600, and the legacy aliases of 2.17, 2.12, 2.5)."""
        major, minor = self.glibc
        aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        out = []
        for m in range(minor, 4, -1):
            out.append(f"manylinux_{major}_{m}_{self.machine}")
            if m in aliases:
                out.append(f"{aliases[m]}_{self.machine}")
        return out

    def tags(self) -> list[Tag]:
        """Wheel tags it installs, most specific first (the order pip prefers)."""
        version, platforms = self.python_tuple, self.platforms()
        return [*cpython_tags(version, platforms=platforms),
                *compatible_tags(version, interpreter="cp{}{}".format(*version), platforms=platforms)]


def read_freeze(path: Path) -> dict[str, str | None]:
    """`pip freeze` output -> {canonical name: version}. A bare name (a package list without versions) and a
    `name @ URL` line mean installed, version unknown; editable lines (`-e`) name no distribution."""
    installed: dict[str, str | None] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-e "):
            continue
        name, sep, version = line.split(" @ ")[0].strip().partition("==")
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"{path}:{number}: not a `pip freeze` line: {raw!r}")
        installed[canonicalize_name(name)] = version.strip() if sep else None
    return installed
