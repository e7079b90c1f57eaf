"""Which engine release, and which wheels the target lacks.

A breadth-first resolver over the wheels' own requirements, for the target's markers (not this machine's): a
requirement the target's installed version meets is left to it (and its own requirements with it); any other
gets the newest version on PyPI that meets every specifier seen so far and has a wheel the target installs. It
does not backtrack: a name re-picked for a narrower specifier keeps the requirements its earlier pick queued
(a superset). A name in `drop` is left out with its whole subtree (never_imported.py says why each is)."""
import re
from collections import deque
from dataclasses import dataclass, field

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from autotune.bundle.index import Index, WheelFile
from autotune.bundle.target import Target

# CUDA majors a requirement names: extras "cu13" / "cu128", package names "...-cu13" / "cupy-cuda13x"
CUDA_EXTRA = re.compile(r"cu(\d\d)\d?")
CUDA_NAME = re.compile(r".*-cu(?:da)?(\d\d)\d?x?")


MAX_RETRIES = 200  # resolutions started again after a conflict (each excludes one version)


class ResolveError(Exception):
    """No wheel the target installs meets a requirement (one line)."""


class _Conflict(Exception):
    """A requirement of (name, version) left some package with no wheel: that version is to be excluded."""

    def __init__(self, name: str, version: Version):
        super().__init__(f"{name} {version}")
        self.name, self.version = name, version


@dataclass(frozen=True)
class Pick:
    wheel: WheelFile
    required_by: tuple[str, ...]  # "sglang 0.5.17: transformers==5.12.1", one per requirement that named it
    replaces: str | None  # the target's installed version it overrides (None: not installed there)


@dataclass
class Resolution:
    engine: WheelFile
    picks: dict[str, Pick] = field(default_factory=dict)
    present: dict[str, str] = field(default_factory=dict)  # met by the target: name -> its installed version
    # met by a package the target has at a version the freeze does not say: name -> specifier to check there
    unchecked: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> the requirements that named it


def applies(req: Requirement, target: Target, extras: set[str]) -> bool:
    """Whether a requirement holds on the target for a dependent installed with `extras`."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(target.markers(extra)) for extra in {"", *extras})


def cuda_majors(requirements: list[Requirement]) -> set[int]:
    found = set()
    for req in requirements:
        for text, pattern in [*((e, CUDA_EXTRA) for e in req.extras), (canonicalize_name(req.name), CUDA_NAME)]:
            if match := pattern.fullmatch(text):
                found.add(int(match.group(1)))
    return found


class Resolver:
    def __init__(self, index: Index, target: Target, drop: dict[str, str] | None = None,
                 add: dict[str, str] | None = None):
        """drop: distributions left out, with why; add: requirements taken as the engine's own, with why."""
        self.index, self.target, self.drop = index, target, {canonicalize_name(n): w for n, w in (drop or {}).items()}
        self.add = [Requirement(r) for r in (add or {})]
        self.rank = {tag: i for i, tag in enumerate(target.tags())}
        self._python_checked: dict[str | None, bool] = {}

    def _rank(self, wheel: WheelFile) -> int | None:
        """How specific the wheel's best tag is for the target (lower is better); None: it cannot install it."""
        if not self._python_ok(wheel.requires_python):
            return None
        ranks = [self.rank[t] for t in wheel.tags if t in self.rank]
        return min(ranks) if ranks else None

    def _python_ok(self, requires_python: str | None) -> bool:
        if requires_python not in self._python_checked:
            try:
                spec = SpecifierSet(requires_python or "")
                ok = spec.contains(self.target.markers()["python_full_version"], prereleases=True)
            except InvalidSpecifier:  # as pip does: an unreadable Requires-Python (old uploads) is ignored
                ok = True
            self._python_checked[requires_python] = ok
        return self._python_checked[requires_python]

    def best_wheel(self, name: str, spec: SpecifierSet, excluded: set = frozenset()) -> WheelFile | None:
        """The target's wheel of the newest version meeting `spec` (pre-releases only if nothing else does)."""
        usable = [w for w in self.index.wheels(name) if self._rank(w) is not None and w.version not in excluded]
        versions = list(spec.filter(sorted({w.version for w in usable}, reverse=True)))
        if not versions:
            return None
        return min((w for w in usable if w.version == versions[0]), key=self._rank)

    def requirements(self, wheel: WheelFile, extras: set[str]) -> list[Requirement]:
        out = []
        for line in self.index.requires(wheel):
            try:
                req = Requirement(line)
            except InvalidRequirement as e:
                raise ResolveError(f"{wheel.filename}: unreadable requirement {line!r}: {e}") from e
            if applies(req, self.target, extras):
                out.append(req)
        return out

    def engine_release(self, engine: str, torch: str, cuda: int) -> WheelFile:
        """The newest release of `engine` (not a pre-release) that pins a torch specifier holding `torch` and names
        no CUDA major other than `cuda` (none named: it follows torch's build)."""
        usable = [w for w in self.index.wheels(engine) if self._rank(w) is not None and not w.version.is_prerelease]
        for version in sorted({w.version for w in usable}, reverse=True):
            wheel = min((w for w in usable if w.version == version), key=self._rank)
            reqs = self.requirements(wheel, set())
            pin = next((r for r in reqs if canonicalize_name(r.name) == "torch"), None)
            if pin is None or not pin.specifier.contains(torch, prereleases=True):
                continue
            if cuda_majors(reqs) - {cuda}:
                continue
            return wheel
        raise ResolveError(f"no {engine} release on PyPI pins torch {torch} with CUDA {cuda} for Python "
                           f"{self.target.python} on {self.target.machine}")

    def resolve(self, engine: WheelFile) -> Resolution:
        """The wheels the target lacks for `engine`. A requirement no wheel meets excludes the version of the
        package whose requirement made it so and starts again (MAX_RETRIES times): flash-attn-4's newest beta
        wants a newer nvidia-cutlass-dsl than sglang 0.5.17 pins, an older beta does not."""
        excluded: dict[str, set] = {}
        for _ in range(MAX_RETRIES):
            try:
                return self._attempt(engine, excluded)
            except _Conflict as conflict:
                excluded.setdefault(conflict.name, set()).add(conflict.version)
        raise ResolveError(f"{engine.name} {engine.version}: no set of wheels found within {MAX_RETRIES} tries "
                           f"(excluded: {excluded})")

    def _attempt(self, engine: WheelFile, excluded: dict[str, set]) -> Resolution:
        res = Resolution(engine)
        specs: dict[str, SpecifierSet] = {}
        extras: dict[str, set[str]] = {}
        named_by: dict[str, list[tuple[str | None, Version | None, Requirement]]] = {}
        queue: deque[tuple[Requirement, str | None, Version | None]] = deque(
            (r, None, None) for r in [*self.requirements(engine, set()), *self.add])  # parent None: the engine
        while queue:
            req, parent, parent_version = queue.popleft()
            name = canonicalize_name(req.name)
            named_by.setdefault(name, []).append((parent, parent_version, req))
            if name in self.drop:
                continue
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
            new_extras = set(req.extras) - extras.setdefault(name, set())
            extras[name] |= new_extras
            if name in self.target.installed and name not in res.picks:
                installed = self.target.installed[name]
                if installed is None:
                    res.unchecked[name] = str(specs[name])
                    continue
                if specs[name].contains(Version(installed), prereleases=True):
                    res.present[name] = installed
                    if new_extras:  # the installed release's requirements for the extras now asked of it
                        wheel = self.best_wheel(name, SpecifierSet(f"=={Version(installed).public}"))
                        if wheel is not None:
                            queue.extend((r, name, wheel.version) for r in self.requirements(wheel, new_extras)
                                         if r.marker is not None)
                    continue
            pick = res.picks.get(name)
            if pick and specs[name].contains(pick.wheel.version, prereleases=True) and not new_extras:
                continue
            wheel = self.best_wheel(name, specs[name], excluded.get(name, set()))
            if wheel is None:
                blamed = next(((p, v) for p, v, _ in reversed(named_by[name]) if p is not None), None)
                if blamed is None:
                    raise ResolveError(f"no wheel of {name}{specs[name]} for Python {self.target.python} on "
                                       f"{self.target.machine} (wanted by {engine.name} {engine.version})")
                raise _Conflict(*blamed)
            res.present.pop(name, None)
            res.picks[name] = Pick(wheel, (), self.target.installed.get(name))
            queue.extend((r, name, wheel.version) for r in self.requirements(wheel, extras[name]))
        by = {name: tuple(f"{p or engine.name} {v or engine.version}: {r}" for p, v, r in reqs)
              for name, reqs in named_by.items()}
        res.picks = {name: Pick(p.wheel, by[name], p.replaces) for name, p in res.picks.items()}
        res.dropped = {name: by[name] for name in named_by if name in self.drop}
        return res
