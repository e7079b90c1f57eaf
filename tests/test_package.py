"""autotune as a user installs it: a wheel built from this checkout, installed into a fresh venv and run from a
directory outside the checkout. The venv sees this machine's site packages (torch and the bundled model come from
here, not the network), and with them an editable autotune that may point anywhere: the venv's own install must
win, and no Python process of the run may open or list a file of the checkout."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from autotune import PROJECT_ROOT

# What the build reads: setup.py maps the top-level data folders into the package.
DATA_FOLDERS = ("search_spaces", "hardware_profiles")
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "autotune", *DATA_FOLDERS)
# Run at start-up by every Python process of the venv (a .pth file imports it), the engine server the study
# launches included: it writes down each path under $CHECKOUT that the process opens or lists.
WATCH_CHECKOUT = '''import os, sys

ROOT, LOG = os.environ.get("CHECKOUT"), os.environ.get("CHECKOUT_READS")


def _watch(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path == ROOT or path.startswith(ROOT + os.sep):
            with open(LOG, "a") as log:
                log.write(f"{event} {path}\\n")


if ROOT and LOG:
    sys.addaudithook(_watch)
'''


class Install:
    def __init__(self, root: Path, wheel: Path):
        self.root, self.wheel = root, wheel
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.work = root / "work"  # the user's directory: not the checkout, not the venv
        self.reads = root / "checkout-reads.log"

    def run(self, *argv, timeout: float = 120) -> subprocess.CompletedProcess:
        """`argv` from the work directory, with nothing pointing at the checkout or at a studies folder."""
        unset = ("PYTHONPATH", "AUTOTUNE_STUDIES_DIR", "AUTOTUNE_COMMIT")
        env = {k: v for k, v in os.environ.items() if k not in unset}
        env.update(CHECKOUT=str(PROJECT_ROOT), CHECKOUT_READS=str(self.reads))
        return subprocess.run([str(a) for a in argv], cwd=self.work, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def checkout_reads(self) -> list[str]:
        return self.reads.read_text().splitlines() if self.reads.exists() else []


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Install:
    root = tmp_path_factory.mktemp("package")
    # The user's project is a git repository with the venv inside: its HEAD is not autotune's commit.
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "-c", "user.name=user", "-c", "user.email=user@example.com", "commit", "-q",
                    "--allow-empty", "-m", "the user's project"], check=True)
    source = root / "source"  # a copy: building in the checkout would leave build/ there, stale files and all
    source.mkdir()
    for name in BUILD_INPUTS:
        if (PROJECT_ROOT / name).is_dir():
            shutil.copytree(PROJECT_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(PROJECT_ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(root / "dist"), str(source)], check=True)
    (wheel,) = (root / "dist").glob("autotune-*.whl")
    install = Install(root, wheel)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(install.venv)],
                   check=True)
    # The system's pip, run by the venv's Python, installs into the venv; --ignore-installed: the system's
    # autotune of the same version is not this wheel.
    subprocess.run([str(install.python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                    "--disable-pip-version-check", str(wheel)], check=True)
    site = subprocess.run([str(install.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "watch_checkout.py").write_text(WATCH_CHECKOUT)
    (Path(site) / "watch_checkout.pth").write_text("import watch_checkout\n")
    install.work.mkdir()
    return install


def test_the_wheel_carries_every_file_of_the_package_and_of_the_data_folders(installed):
    package = PROJECT_ROOT / "autotune"
    expected = {f"autotune/{p.relative_to(package).as_posix()}" for p in package.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    expected |= {f"autotune/{folder}/{p.name}" for folder in DATA_FOLDERS for p in (PROJECT_ROOT / folder).iterdir()}
    assert sorted(expected - set(zipfile.ZipFile(installed.wheel).namelist())) == []


def test_installed_package_reads_its_data_from_the_venv(installed):
    paths = """
import json, autotune
from autotune.space.space import SPACES_DIR
from autotune.hardware.profiles import PROFILES_DIR
from autotune.engines.base import SCHEMA_DIR
from autotune.bench.workloads import SHIPPED
from autotune.estimator.engine_settings import SUPPORT
from autotune.embedded.quantize import KERNEL_SOURCES
from autotune.predict import acceptance, checkpoints, gguf_types, models
print(json.dumps({"module": autotune.__file__, "version": autotune.__version__, "data": [str(p) for p in (
    SPACES_DIR / "embedded.yaml", PROFILES_DIR / "cpu.yaml", SCHEMA_DIR, SHIPPED, SUPPORT, *KERNEL_SOURCES,
    acceptance.DATA_FILE, checkpoints.CHECKPOINTS_FILE, gguf_types.TYPES_FILE, models.PRESETS_FILE)]}))
"""
    done = installed.run(installed.python, "-c", paths)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert Path(found["module"]).is_relative_to(installed.venv), found["module"]
    for path in map(Path, found["data"]):
        assert path.is_relative_to(installed.venv) and path.exists(), path
    wheel_version = installed.wheel.name.split("-")[1]
    assert found["version"] == wheel_version

    version = installed.run(installed.venv / "bin" / "autotune", "--version")
    assert version.returncode == 0 and version.stdout.split() == ["autotune", wheel_version], version

    probe = installed.run(installed.venv / "bin" / "autotune", "probe", "--json", timeout=300)
    assert probe.returncode == 0, probe.stderr
    profile = json.loads(probe.stdout)["profile"]["name"]
    assert (Path(found["data"][1]).parent / f"{profile}.yaml").exists()  # matched among the packaged profiles
    assert installed.checkout_reads() == []


@pytest.mark.slow
def test_two_trial_run_writes_its_study_under_the_working_directory(installed):
    done = installed.run(installed.venv / "bin" / "autotune", "run", "--gpu", "auto", "--study", "from-wheel",
                         "--trials", "2", "--budget", "4m", "--num-requests", "4", "--max-tokens", "24",
                         "--min-measure", "0", "--no-estimator", timeout=840)
    assert done.returncode == 0, done.stderr[-2000:]
    study = installed.work / "studies" / "from-wheel"
    assert (study / "study.db").exists() and (study / "best" / "launch.sh").exists()
    provenance = json.loads((study / "provenance.json").read_text())
    assert Path(provenance["space"]).is_relative_to(installed.venv), provenance["space"]  # the wheel's space
    assert provenance["commit"] is None  # no checkout: neither this one's HEAD nor the user's project's
    assert not (PROJECT_ROOT / "studies" / "from-wheel").exists()
    assert installed.checkout_reads() == []
