"""autotune bundle: resolution against PyPI itself (no recorded answers: PyPI unreachable fails the test, saying
so), markers evaluated for a target that is not this machine, parts that join back to the same bytes, and the
generated install.sh installing real wheels offline and refusing a corrupted part."""
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag
from packaging.version import Version

from autotune.bundle.command import lay_out
from autotune.bundle.download import fetch_all, sha256_of
from autotune.bundle.index import Index
from autotune.bundle.pack import pack
from autotune.bundle.resolve import Resolver, applies
from autotune.bundle.script import install_script, write_install_script
from autotune.bundle.split import batches, join, parse_size, split_file
from autotune.bundle.target import Target, read_freeze

ROOT = Path(__file__).resolve().parents[2]
# Python 3.12 on x86_64 Linux (the H200's), deliberately not this machine's Python
TARGET_PY = "3.12"


def _index() -> Index:
    return Index(timeout_s=120.0)


def test_freeze_lines(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# comment\nTorch==2.11.0+cu130\nnumpy\nsome_pkg @ file:///x.whl\n-e git+https://x#egg=y\n")
    assert read_freeze(freeze) == {"torch": "2.11.0+cu130", "numpy": None, "some-pkg": None}
    freeze.write_text("torch>=2\n")
    with pytest.raises(ValueError, match="freeze.txt:1"):
        read_freeze(freeze)


def test_markers_are_the_targets_not_this_machines():
    target = Target(TARGET_PY)
    only_312 = Requirement('tomllib-backport; python_version >= "3.12"')
    assert applies(only_312, target, set())
    assert only_312.marker.evaluate() == (sys.version_info >= (3, 12))  # this machine's own answer may differ
    assert not applies(Requirement('tomli; python_version < "3.11"'), target, set())
    # sglang 0.5.17's own platform markers: torchcodec on x86_64 Linux, av and decord2 only on Arm
    assert applies(Requirement('torchcodec==0.11.1; sys_platform != "linux" or (sys_platform == "linux" and '
                               'platform_machine != "aarch64" and platform_machine != "arm64")'), target, set())
    assert not applies(Requirement('av==16.1.0; sys_platform == "linux" and (platform_machine == "aarch64" or '
                                   'platform_machine == "arm64")'), target, set())
    # an extra's requirement holds only for a dependent that asked for the extra
    cu13 = Requirement('nvidia-cutlass-dsl-libs-cu13==4.6.0; extra == "cu13"')
    assert applies(cu13, target, {"cu13"}) and not applies(cu13, target, set())
    tags = set(target.tags())
    assert Tag("cp312", "cp312", "manylinux_2_28_x86_64") in tags and Tag("cp312", "abi3", "manylinux2014_x86_64") in tags
    assert Tag("cp311", "cp311", "manylinux_2_28_x86_64") not in tags
    assert Tag("cp312", "cp312", "manylinux_2_39_x86_64") not in tags  # newer than the target's glibc 2.35


def test_resolution_against_pypi_for_a_freeze():
    """httpx 0.27.0 for a Python 3.12 target that has certifi (new enough), an httpcore too old, and idna at a
    version its freeze does not say."""
    target = Target(TARGET_PY, installed={"certifi": "2024.2.2", "httpcore": "0.9.0", "idna": None})
    resolver = Resolver(_index(), target)
    root = resolver.best_wheel("httpx", SpecifierSet("==0.27.0"))
    assert root is not None and root.filename == "httpx-0.27.0-py3-none-any.whl"
    res = resolver.resolve(root)
    assert res.present == {"certifi": "2024.2.2"}
    assert set(res.unchecked) == {"idna"}  # left to the machine (with what anyio asks of it): install.sh --check
    assert {"anyio", "httpcore", "sniffio", "h11"} <= set(res.picks)
    assert not {"certifi", "idna", "httpx"} & set(res.picks)
    httpcore = res.picks["httpcore"]
    assert httpcore.replaces == "0.9.0" and httpcore.wheel.version.major == 1  # httpx 0.27.0 wants httpcore==1.*
    assert any("httpcore==1.*" in why for why in httpcore.required_by)
    # every pick is a wheel the target installs, with the sha256 and size the index publishes
    rank = set(target.tags())
    for pick in res.picks.values():
        assert pick.wheel.tags & rank, pick.wheel.filename
        assert len(pick.wheel.sha256) == 64 and pick.wheel.size > 0
    for pick in res.picks.values():  # each meets every requirement that named it
        for why in pick.required_by:
            req = Requirement(why.split(": ", 1)[1])
            assert req.specifier.contains(pick.wheel.version, prereleases=True), (pick.wheel.filename, why)


def test_an_added_requirement_survives_the_drop_of_the_only_package_that_named_it():
    """As sglang's server imports dill and jsonschema that only dropped packages require: h11 is named only by
    httpcore; with httpcore dropped it goes too, unless added, and then it is resolved as the engine's own."""
    target = Target(TARGET_PY)
    root = Resolver(_index(), target).best_wheel("httpx", SpecifierSet("==0.27.0"))
    dropped = Resolver(_index(), target, {"httpcore": "not imported"}).resolve(root)
    assert "httpcore" in dropped.dropped and "h11" not in dropped.picks
    added = Resolver(_index(), target, {"httpcore": "not imported"}, {"h11>=0.14": "imported"}).resolve(root)
    assert "httpcore" not in added.picks and added.picks["h11"].wheel.version >= Version("0.14")
    assert added.picks["h11"].required_by == ("httpx 0.27.0: h11>=0.14",)


def test_engine_release_matches_the_targets_torch_and_cuda():
    resolver = Resolver(_index(), Target(TARGET_PY))
    picked = resolver.engine_release("sglang", "2.11.0", 13)
    assert str(picked.version) == "0.5.17"  # the newest release that pins torch 2.11.0 (0.5.18-0.5.21 pin 2.13.0)
    requires = [Requirement(r) for r in resolver.index.requires(picked)]
    assert any(r.name == "torch" and r.specifier.contains("2.11.0") for r in requires)
    assert any("cu13" in r.extras for r in requires)
    assert Tag("cp312", "cp312", "manylinux_2_34_x86_64") in picked.tags
    newer = resolver.engine_release("sglang", "2.13.0", 13)
    assert newer.version > picked.version


def test_split_join_and_batches_round_trip(tmp_path):
    data = os.urandom(250_000)
    big, small = tmp_path / "big.whl", tmp_path / "small.whl"
    big.write_bytes(data)
    small.write_bytes(data[:1000])
    parts = split_file(big, 100_000, tmp_path / "parts") + split_file(small, 100_000, tmp_path / "parts")
    assert [p.name for p in parts] == ["big.whl.part000", "big.whl.part001", "big.whl.part002", "small.whl"]
    assert [p.size for p in parts] == [100_000, 100_000, 50_000, 1000]
    assert all(p.sha256 == sha256_of(tmp_path / "parts" / p.name) for p in parts)
    joined = join([tmp_path / "parts" / p.name for p in parts[:3]], tmp_path / "joined.whl")
    assert sha256_of(joined) == hashlib.sha256(data).hexdigest()
    groups = batches(parts, 120_000)
    assert sorted(p.name for g in groups for p in g) == sorted(p.name for p in parts)
    assert all(sum(p.size for p in g) <= 120_000 for g in groups) and len(groups) == 3
    assert parse_size("40M") == 40 << 20 and parse_size("1.5K") == 1536 and parse_size("512") == 512
    with pytest.raises(ValueError):
        parse_size("lots")


def _bundle(tmp_path: Path, extra: list[Path] = (), packed: dict | None = None,
            helpers: list[Path] = ()) -> tuple[Path, Path]:
    """Real wheels (six, idna) from PyPI, and `extra` ones, as parts of 32 KiB in numbered folders, laid out as
    the command lays them out, and their install.sh."""
    resolver = Resolver(_index(), Target(TARGET_PY))
    wheels = [resolver.best_wheel("six", SpecifierSet("==1.16.0")), resolver.best_wheel("idna", SpecifierSet("==3.7"))]
    paths = fetch_all(wheels, tmp_path / "wheels") + list(extra)
    parts, _, rows = lay_out(tmp_path, paths, packed or {}, list(helpers), 32 << 10)
    assert any(p.name != p.wheel for p in parts)  # idna's wheel (66 KB) travels in pieces
    assert [r.sha256 for r in rows[:2]] == [w.sha256 for w in wheels]
    script = write_install_script(tmp_path / "install.sh", install_script(
        "test bundle", parts, rows[:len(paths)], {"packaging": ">=20", "not-installed-anywhere-xyz": ""},
        rows[len(paths)] if helpers else None))
    return script, tmp_path / "parts"


def _redundant_wheel(folder: Path) -> Path:
    """A real, installable wheel whose 12 modules share one 64 KB block of random text: deflate packs each member
    alone (about 12 x 33 KB), zstd's long window sees the block once."""
    block = os.urandom(32 << 10).hex()
    files = {f"bundle_probe/m{i}.py": f"DATA = {block!r}\nINDEX = {i}\n" for i in range(12)}
    files["bundle_probe/__init__.py"] = ""
    files["bundle_probe-1.0.dist-info/METADATA"] = "Metadata-Version: 2.1\nName: bundle-probe\nVersion: 1.0\n"
    files["bundle_probe-1.0.dist-info/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for name, text in files.items()]
    files["bundle_probe-1.0.dist-info/RECORD"] = "\n".join(record + ["bundle_probe-1.0.dist-info/RECORD,,"]) + "\n"
    path = folder / "bundle_probe-1.0-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, argv)], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHON": sys.executable})


def test_install_script_installs_offline_and_refuses_a_corrupted_part(tmp_path):
    script, parts = _bundle(tmp_path)
    site = tmp_path / "site"
    done = _run(script, "--target", site, parts)
    assert done.returncode == 0, done.stderr
    assert "2 wheels checked" in done.stdout and "unmet: not-installed-anywhere-xyz" in done.stdout
    imported = subprocess.run([sys.executable, "-c", "import six, idna; print(six.__file__, idna.__file__)"],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)}, check=True)
    assert imported.stdout.count(str(site)) == 2
    # --check installs nothing and fails on the unmet requirement
    check = _run(script, "--check")
    assert check.returncode == 1 and "unmet: not-installed-anywhere-xyz: not installed" in check.stdout
    # one flipped byte in one piece: refused before anything is installed
    piece = next(p for p in parts.rglob("idna-*.part001"))
    raw = bytearray(piece.read_bytes())
    raw[100] ^= 0xFF
    piece.write_bytes(bytes(raw))
    other = tmp_path / "other-site"
    refused = _run(script, "--target", other, parts)
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"install.sh: part {piece.name} is corrupted (its sha256 differs)"
    assert not other.exists()
    piece.unlink()
    missing = _run(script, "--target", other, parts)
    assert missing.returncode == 1 and f"part {piece.name} is missing" in missing.stderr


def test_command_refuses_bad_input_in_one_line(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.11.0\n")
    base = [sys.executable, "-m", "autotune.bundle.command", "--engine", "sglang", "--torch", "2.11.0", "--cuda", "13",
            "--target-freeze", str(freeze), "--out", str(tmp_path / "out")]
    for extra, says in ((["--part-size", "lots"], "not a size"), (["--glibc", "two"], "not a version")):
        done = subprocess.run(base + extra, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_packed_wheel_travels_smaller_and_installs_where_the_machine_has_no_zstd(tmp_path):
    """The redundant wheel packs to under a third of its deflated size; install.sh, on a PATH without zstd and
    with a Python that has no zstandard, decompresses it with the bundle's own zstandard wheel and installs it."""
    probe = _redundant_wheel(tmp_path / "built")
    packed = pack(probe, tmp_path / "packed")
    assert packed is not None and packed.path.stat().st_size < probe.stat().st_size / 3
    assert pack(fetch_all([Resolver(_index(), Target(TARGET_PY)).best_wheel("six", SpecifierSet("==1.16.0"))],
                          tmp_path / "six")[0], tmp_path / "packed-six") is None  # saves too little: as it is
    here = f"{sys.version_info.major}.{sys.version_info.minor}"  # the helper runs in this test's Python
    helper = Resolver(_index(), Target(here)).best_wheel("zstandard", SpecifierSet())
    script, parts = _bundle(tmp_path, [probe], {probe.name: packed}, fetch_all([helper], tmp_path / "helper"))
    carried = [path.name for path in parts.rglob(probe.name + "*")]
    assert carried and all(name.startswith(probe.name + ".zst") for name in carried)
    bare = tmp_path / "bare"  # a Python without zstandard, and a PATH with the tools install.sh uses but zstd
    subprocess.run([sys.executable, "-m", "venv", bare], check=True)
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "cat", "cp", "dirname", "find", "mkdir", "mktemp", "rm", "seq", "sha256sum"):
        (tools / tool).symlink_to(shutil.which(tool))
    python = bare / "bin" / "python"
    assert subprocess.run([python, "-c", "import zstandard"], capture_output=True, check=False).returncode != 0
    site = tmp_path / "site"
    done = subprocess.run(["bash", script, "--target", site, parts], capture_output=True, text=True, timeout=300,
                          check=False, env={"PATH": str(tools), "PYTHON": str(python), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "3 wheels checked" in done.stdout
    read = subprocess.run([python, "-c", "import bundle_probe.m11 as m; print(m.INDEX, len(m.DATA))"], check=True,
                          capture_output=True, text=True, env={"PYTHONPATH": str(site)})
    assert read.stdout.split() == ["11", str(64 << 10)]
